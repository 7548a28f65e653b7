"""The recipe's configuration: `RecipeConfig` and its sections, declared once (sections.py), layered from
defaults, presets, a config file, flags and --set (layering.py, resolution.py), and the command line made from
the same declarations (command_line.py). Importing this package imports no jax: the sections and the flag helpers
(fields.py) are what `nnx-surgery COMMAND --help` needs."""
from nnx_surgery.recipes.config.sections import (AotSection, DataSection, EvaluationSection, MultiHostSection,
                                                 RecipeConfig, RunSection, SearchSection, StudentSection,
                                                 SurgerySection, TeacherSection, TrainingSection)

__all__ = ["RecipeConfig", "RunSection", "TeacherSection", "StudentSection", "SurgerySection", "DataSection",
           "TrainingSection", "SearchSection", "EvaluationSection", "AotSection", "MultiHostSection"]
