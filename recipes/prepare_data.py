"""Recipe: conversations -> tokenized, loss-masked turns on disk (optionally with regenerated answers).

    python recipes/prepare_data.py [data=jsonl data.path=chats.jsonl] [regenerate=greedy] [output_dir=...]
    specheads prepare ...            (same overrides)
"""

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from specheads.data.images import load_vision
from specheads.data.prepare import PrepareConfig, check_prepare_output, prepare, prepared_is_current
from specheads.data.regenerate import RegenerateConfig
from specheads.data.sources import check_sources
from specheads.errors import user_errors
from specheads.hardware import resolve_device
from specheads.overrides import check_command_line
from specheads.targets import Target, load_target, load_tokenizer
from specheads.targets.context import check_fits_context, context_limit, read_context_limit

log = logging.getLogger("specheads.prepare")


@hydra.main(config_path="../conf", config_name="prepare_data", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("prepare"):
        run(cfg)


def template_kwargs(target_cfg: DictConfig) -> dict:
    """The target's chat-template switches (``target.chat_template_kwargs``) as a plain dict."""
    kw = target_cfg.get("chat_template_kwargs")
    return OmegaConf.to_container(kw, resolve=True) if kw else {}


def check_config(cfg: DictConfig) -> PrepareConfig:
    """Every setting's value, with no file read (``specheads run`` calls it before its first stage)."""
    regen = cfg.get("regenerate")
    return PrepareConfig(**OmegaConf.to_object(cfg.data),
                         regenerate=RegenerateConfig(**OmegaConf.to_container(regen, resolve=True)) if regen else None,
                         chat_template_kwargs=template_kwargs(cfg.target))


def run(cfg: DictConfig) -> None:
    regen = cfg.get("regenerate")
    pcfg = check_config(cfg)
    resolve_device(cfg.target.device)  # a device this machine lacks, though only regeneration loads the target
    check_prepare_output(cfg.output_dir)  # before the target loads: a folder it must not replace, a missing source
    check_sources(pcfg.source, pcfg.path, pcfg.parts)
    if regen and regen.get("engine"):  # vLLM answers: the config and tokenizer only, no weights read here
        from specheads.data.engine_features import meta_target

        target = meta_target(cfg.target.name_or_path, cfg.target.get("chat_template"))
    elif regen and not regen.get("endpoint"):
        target = load_target(cfg.target.name_or_path, cfg.target.dtype, cfg.target.device,
                             chat_template=cfg.target.get("chat_template"))
    else:  # only the tokenizer is needed (a serving endpoint answers, or nothing is regenerated)
        target = Target.tokenizer_only(load_tokenizer(cfg.target.name_or_path, cfg.target.get("chat_template")),
                                        cfg.target.name_or_path)
    # rows up to the target's context, none past it: a longer data.max_length is refused before any work
    limit = (context_limit(target.model.config, target.tokenizer) if target.model is not None
             else read_context_limit(cfg.target.name_or_path, target.tokenizer))
    check_fits_context("data.max_length", pcfg.max_length, limit, cfg.target.name_or_path)
    # a vision-language target's image processor: image chats render with it (None for a text-only target)
    vision = load_vision(cfg.target.name_or_path, target.tokenizer)
    if not cfg.overwrite and prepared_is_current(cfg.output_dir, pcfg, target, vision):
        log.info("%s is already prepared with this configuration; skipping (overwrite=true redoes it)", cfg.output_dir)
        return
    meta = prepare(target, pcfg, cfg.output_dir, vision)
    print(f"prepared {meta['num_samples']} samples, {meta['num_tokens']} tokens "
          f"({meta['num_loss_tokens']} assistant) -> {cfg.output_dir}; skipped: {meta['skipped']}")


if __name__ == "__main__":
    check_command_line("prepare", "prepare_data", sys.argv[1:])  # a refused override: one line
    main()
