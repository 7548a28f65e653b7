"""Test order for `make test`'s two worker processes (pytest-xdist, `--dist loadfile`).

The workers take whole modules in collection order as they become free. Alphabetical order puts several of the
longest modules (the recipe runs, the search, the soak) last, so one worker often ran one of them alone at the
end while the other had nothing left. Modules with more `slow` tests are handed out first, the quick modules fill
the gaps at the end; the order inside a module, and between modules of equal weight, is kept.
"""
from __future__ import annotations

import collections


def pytest_collection_modifyitems(session, config, items) -> None:
    slow_per_module: collections.Counter = collections.Counter()
    for item in items:
        if item.get_closest_marker("slow") is not None:
            slow_per_module[item.nodeid.split("::")[0]] += 1
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-slow_per_module[item.nodeid.split("::")[0]], position[id(item)]))
