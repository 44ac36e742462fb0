"""A recipe's command line composed as Hydra will compose it, before the recipe runs: a mistyped setting, a value
of the wrong type or an override Hydra cannot parse becomes one ``ConfigError`` line naming the override (with the
settings it may have meant), where Hydra's own report spans several lines and exits 1.

Recipes call ``check_command_line`` before their ``@hydra.main`` function (their schemas are registered by then);
``specheads run`` composes every stage's settings with ``compose`` before the first stage starts, so that a typo in
``evaluate.<setting>`` costs a second, not the prepare, collect and train stages before it.
"""

from __future__ import annotations

import difflib

from omegaconf import DictConfig, OmegaConf

from specheads.errors import ConfigError, user_errors


def compose(config_name: str, overrides: list[str], verb: str) -> DictConfig:
    """The recipe ``config_name``'s settings with ``overrides`` applied, as ``@hydra.main`` composes them; a
    ``ConfigError`` naming the override that Hydra refuses (``verb``: the ``specheads`` verb of the recipe, for
    the hint). The recipe's schemas must be registered (its module imported)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    _check_parses(overrides)
    if GlobalHydra.instance().is_initialized():
        raise RuntimeError("compose() runs before Hydra starts (it initializes Hydra itself)")
    try:
        return _hydra_compose(config_name, overrides)
    except HydraException as e:
        raise _refusal(e, config_name, overrides, verb) from None


def check_command_line(stage: str, config_name: str, argv: list[str]) -> None:
    """``compose`` the recipe's command line (``sys.argv[1:]``) before ``@hydra.main`` does: a refused override
    ends the run with ``specheads <stage>: error: ...`` and exit status 2. A command line with one of Hydra's own
    options (``--cfg job``, ``-m``) is left to Hydra."""
    if any(arg.startswith("-") for arg in argv):  # Hydra's own options change what it does
        return
    with user_errors(stage):
        compose(config_name, argv, stage)


def _check_parses(overrides: list[str]) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as e:
            raise ConfigError(f"cannot parse {override!r}: {_grammar(e.message)}; quote a value holding spaces, "
                              "brackets or '=': key='a value'") from None


def _refusal(error: Exception, config_name: str, overrides: list[str], verb: str) -> ConfigError:
    """Hydra's refusal of one of ``overrides`` as one line: the override, what is wrong, what to give instead."""
    from hydra.errors import MissingConfigException

    if isinstance(error, MissingConfigException) and error.options:
        group, _, name = str(error.missing_cfg_file or "").rpartition("/")
        return ConfigError(f"{group}={name}: no {group} named '{name}'; choose one of: {', '.join(error.options)}"
                           f" (the files of conf/{group}/)")
    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    # the last override of the key: Hydra applies them in order
    override = next((o for o in reversed(overrides) if f"{_key(o)}.".startswith(f"{key}.")), None) if key else None
    if override is None:
        return ConfigError(_first_paragraph(str(error)))
    if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError"):
        return ConfigError(f"{override}: {_unknown(key, override, config_name, overrides, verb)}")
    return ConfigError(f"{override}: {_first_line(str(cause))}")


def _unknown(key: str, override: str, config_name: str, overrides: list[str], verb: str) -> str:
    """What to say of a setting the config has no key for: the keys beside it that look like it, or the ``+``
    that adds it where the config takes new keys there."""
    others = [o for o in overrides if o != override]
    parent, _, leaf = key.rpartition(".")
    names, open_mapping = [], False
    try:
        node = _hydra_compose(config_name, others)
        for part in parent.split(".") if parent else ():
            node = node[part]
        if isinstance(node, DictConfig):  # a schema's node (a dataclass) takes no key it does not declare
            names, open_mapping = [str(n) for n in node.keys()], OmegaConf.get_type(node) is dict
    except Exception:  # the other overrides fail too, or the parent is no mapping: no suggestion
        pass
    near = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
    where = f"{parent}." if parent else ""
    said = f"no setting {key}"
    if near:
        said += f"; did you mean {' or '.join(where + n for n in near)}?"
    elif open_mapping and not override.startswith("+"):
        try:
            _hydra_compose(config_name, [*others, "+" + override])
            return said + f"; to add it, write +{override}"
        except Exception:
            pass
    return said + f" (`specheads {verb} --cfg job` prints every setting{' under ' + parent if parent else ''})"


def _hydra_compose(config_name: str, overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specheads import paths

    with initialize_config_dir(config_dir=str(paths.conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def _first_paragraph(text: str) -> str:
    """Hydra's message up to its config search path, on one line."""
    kept = []
    for line in text.splitlines():
        if line.startswith("Config search path"):
            break
        if line.strip():
            kept.append(line.strip())
    return "; ".join(kept) or text


def _grammar(message: str) -> str:
    """The parser's complaint without its list of every token it expected."""
    lines = [line for line in message.splitlines() if line.strip() and not line.startswith("See https")]
    text = lines[-1] if lines else message
    return text.split(" expecting {")[0]
