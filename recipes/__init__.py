"""The Hydra recipes, shipped as ``specheads.recipes`` (``python -m specheads.recipes.train ...``).

``pyproject.toml`` maps this folder to ``specheads.recipes`` and ``conf/`` to ``specheads.conf``, so
each recipe's ``config_path="../conf"`` finds the configs in a clone and in an installed copy alike.
"""
