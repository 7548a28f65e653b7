"""The order `make test` hands modules to its workers (tests/conftest.py): the slowest first, tests kept in order."""
from __future__ import annotations

import os
from types import SimpleNamespace

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_module_named_slowest_first_exists_once():
    names = conftest.SLOWEST_FIRST
    assert len(set(names)) == len(names)
    missing = [name for name in names if not os.path.isfile(os.path.join(ROOT, name))]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names modules that do not exist: {missing}"


def test_listed_modules_come_first_in_their_order_and_tests_keep_theirs():
    first, second = conftest.SLOWEST_FIRST[:2]
    ids = ["tests/test_a.py::x", f"{second}::one", "tests/test_a.py::y", f"{first}::two", f"{second}::three",
           "tests/test_b.py::z"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [f"{first}::two", f"{second}::one", f"{second}::three",
                                        "tests/test_a.py::x", "tests/test_a.py::y", "tests/test_b.py::z"]
