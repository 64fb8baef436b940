"""Import paths of modules that moved into sub-packages keep working (issue #27).

``import prorl_server.llm_client`` (or ``from prorl_server.agent_loop import ...``) gives the very module object
of its new path, ``prorl_server.llm.client``, so isinstance checks and monkeypatching see one module, with a
:class:`DeprecationWarning` that names the new path. Installed by ``prorl_server/__init__.py``; it resolves only
the names in :data:`MOVED`, after every other finder has failed (the old files no longer exist).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module name -> new module name
MOVED = {f"prorl_server.{old}": f"prorl_server.{new}" for old, new in (
    ("llm_client", "llm.client"), ("conversation", "llm.conversation"), ("turn", "llm.turn"),
    ("tool_parser", "llm.tool_parser"), ("chat_templates", "llm.chat_templates"), ("llm_context", "llm.context"),
    ("agent_loop", "llm.agent_loop"), ("tiny_model", "dev.tiny_model"), ("vllm_launcher", "dev.vllm_launcher"),
    ("fake_vllm", "dev.fake_vllm"), ("journal_cli", "journal.cli"), ("journal_export", "journal.export"),
    ("regrade", "journal.regrade"))}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta path finder and loader whose module for an old name is the already imported new module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # the new module ran when it was imported
        return None


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
