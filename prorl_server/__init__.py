"""The ProRL rollout server. Public import paths for handlers and trainer plugins: README.md, "Public import
paths"."""
from prorl_server import _moved

_moved.install()
