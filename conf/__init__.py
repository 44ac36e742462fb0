"""The Hydra configs, shipped as ``specheads.conf`` (package data; see ``pyproject.toml``).

Importable so that ``pkg://specheads.conf`` and ``hydra.initialize_config_module("specheads.conf")``
work on an installed copy; ``specheads.paths.conf_dir()`` gives the folder.
"""
