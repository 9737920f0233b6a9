"""The strict mode of ``cargo xtask test``, shared by ``conftest.py`` and the test modules.

``cargo xtask test`` installs everything this suite needs (torch and transformers
included) and sets ``ATTN_TEST_NO_SKIP=1``: there a missing optional module is an import
error and any test that skips fails (the hook in ``conftest.py``), since a skip would hide
a test that CI claims to run. Run by hand without that variable, the torch tests skip when
torch is absent, with the reason shown (``-rs``).
"""

import importlib
import os

import pytest

NO_SKIP = os.environ.get("ATTN_TEST_NO_SKIP") == "1"


def optional_import(name, why):
    """``import name``: under ``cargo xtask test`` a plain import, which fails loudly when
    the module is missing; otherwise ``pytest.importorskip`` with ``why`` as the reason."""
    if NO_SKIP:
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=why)
