"""Measured chain acceptance of EAGLE-3 heads on fixed ShareGPT prompts (run by hand; the table in docs/ablations.md).

    .venv/bin/python scripts/bench/measure_chain.py --skip 1500 --prompts 24 --k 3 runs/ablate/a/head runs/ablate/b/head

Takes the first user turn of the packaged ShareGPT records after the first ``--skip`` (pick a number past
what the heads were trained on: `data.num_samples` reads from the start), renders it with the target's chat
template, and decodes ``--new-tokens`` tokens per prompt with each head as a greedy chain of ``--k`` drafts on
the float32 target (the evaluator's engine). Prints one JSON line per head: τ (tokens per target forward),
α (accepted ÷ tested drafts) and the share of steps whose first d drafts were accepted (d = 1..k).
Every head sees the same prompts, so their figures compare; no timing is involved.
"""

from __future__ import annotations

import argparse
import itertools
import json

from specheads.data.sources import iter_conversations
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.head_drafters import EagleDrafter
from specheads.decoding.runner import TargetRunner
from specheads.models.eagle3 import Eagle3Model
from specheads.targets import eos_token_ids, load_target


def prompts_from_sharegpt(tokenizer, skip: int, n: int, max_tokens: int = 384) -> list[list[int]]:
    out = []
    for conv in itertools.islice(iter_conversations("sharegpt"), skip, None):
        user = next(m["content"] for m in conv.messages if m["role"] == "user")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        if 8 <= len(ids) <= max_tokens:
            out.append(ids)
        if len(out) >= n:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("heads", nargs="+", help="EAGLE-3 head folders (train output's head/)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--skip", type=int, default=1500, help="ShareGPT records skipped before the prompts")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    target = load_target(args.target, dtype="float32", device="cpu")
    prompts = prompts_from_sharegpt(target.tokenizer, args.skip, args.prompts)
    runner, eos = TargetRunner(target.model), eos_token_ids(target)
    for head in args.heads:
        drafter = EagleDrafter(Eagle3Model.from_pretrained(head).eval().attach(target), TreeShape("chain", k=args.k),
                               "eagle3")
        emitted = steps = accepted = tested = 0
        reach = [0] * args.k
        for prompt in prompts:
            s = speculative_generate(runner, drafter, [prompt], args.new_tokens, 0.0, "greedy", eos).stats[0]
            emitted, steps = emitted + s.emitted, steps + s.steps
            accepted, tested = accepted + sum(s.accepted), tested + sum(s.tested)
            for d, a in enumerate(s.accepted[: args.k]):
                reach[d] += a
        print(json.dumps({"head": head, "tau": round(emitted / steps, 3), "alpha": round(accepted / max(tested, 1), 3),
                          "reach": [round(r / steps, 3) for r in reach], "prompts": len(prompts)}), flush=True)


if __name__ == "__main__":
    main()
