"""verl 0.9.1 adapter: :class:`trainer_plugins.verl.agent_loop.ProRLAgentLoop` (an ``AgentLoopBase`` that runs
each row as a job on a ProRL rollout server) and Hydra configs for async DAPO and CISPO in ``config/``.

Importing this package does not import verl; ``trainer_plugins.verl.agent_loop`` does.
"""
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "config"
"""Hydra config directory: ``prorl_dapo.yaml``, ``prorl_cispo.yaml`` and the agent loop registry
``agent_loop.yaml``."""


def package_file(package: str, relative: str) -> str:
    """Absolute path of the file ``relative`` (``/``-separated) inside the installed ``package``, as found by
    the importing process on its own node (``importlib.resources``).

    The shipped configs name the agent loop registry as ``${prorl.package_file:trainer_plugins.verl,
    config/agent_loop.yaml}``: verl ships its config unresolved from the driver to its TaskRunner actor, which
    resolves it without Hydra wherever Ray placed it, so a path relative to the driver's cwd, or Hydra's
    ``${hydra:...}``, does not resolve there. Raises ``FileNotFoundError`` naming the package when the file is
    not there (a broken install)."""
    from importlib.resources import files

    path = files(package).joinpath(*relative.split("/"))
    if not path.is_file():
        raise FileNotFoundError(f"{relative} is not in the installed package {package} ({path})")
    return str(path)


def _register_resolvers() -> None:
    # Every process that loads the plugin's modules registers the resolver: verl's driver and each Ray worker
    # import trainer_plugins.verl.cpu_platform through VERL_USE_EXTERNAL_MODULES (the shipped configs' runtime_env).
    try:
        from omegaconf import OmegaConf
    except ImportError:  # no Hydra/verl in this environment: nothing resolves verl configs here
        return
    if not OmegaConf.has_resolver("prorl.package_file"):
        OmegaConf.register_new_resolver("prorl.package_file", package_file)


_register_resolvers()
