"""Singularity/Apptainer sandbox images: :mod:`singularity.build` (the ``prorl-build-image`` command) and the
Jinja2 definition templates in ``singularity/templates/``, shipped inside this package.

Nothing here is imported by the rollout server or by :mod:`sandbox`; the sandbox runtime only runs images
built here (``sandbox.singularity``).
"""
