"""Builds ``prorl_server._tree_c``, the group tree's build and check in C (issue #34; the algorithm and the
reference code are in prorl_server/tree.py). Everything else about the package is in setup.cfg (setuptools
reads ext_modules from setup.py only, while the metadata stays in setup.cfg). The extension is optional: an
install without a C compiler goes on, and prorl_server.tree runs its own Python code (the same trees, 2-10x
slower)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("prorl_server._tree_c", ["prorl_server/_tree_c.c"], optional=True)])
