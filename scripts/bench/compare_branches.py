"""Plain decoding vs an EAGLE head's fan with the prompt-lookup branch, without and with its first draft
continued from an n-gram table: the three decoded in turn per prompt, several passes (run by hand; the
figures of the README's n-gram table paragraph).

    .venv/bin/python scripts/bench/compare_branches.py --head runs/quickstart/train/eagle3/head --fan 3 \\
        --table runs/quickstart/features --chat-dir runs/quickstart/prepared --passes 3

Prompts: the pipeline's default subset (one MT-bench question per category, turn 1; 2 HumanEval tasks;
2 held-out chats of ``--chat-dir``), or ``--jsonl``. The target is set up as the evaluator sets it up
(float32, prepacked CPU linears, grouped attention); the order of the two speculative variants alternates
between prompts and passes. Prints, after each pass, the speed-up of each variant over plain decoding
(total decode time, prefill excluded, over all prompts so far) and its τ, and checks that every greedy
output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import json

from specheads.decoding.cpu_linears import pack_cpu_linears, pack_like
from specheads.decoding.drafters import PromptLookupBranch, TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.grouped_attention import use_grouped_attention
from specheads.decoding.head_drafters import EagleDrafter
from specheads.decoding.runner import TargetRunner
from specheads.evaluation.prompts import BenchmarkSpec, encode, load_benchmarks, scored_chat_ids
from specheads.evaluation.suite import load_ngram_table
from specheads.models.eagle3 import Eagle3Model
from specheads.targets import eos_token_ids, load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="an EAGLE-3 head folder (the train output's head/)")
    p.add_argument("--table", required=True, help="feature store or prepared dataset of the n-gram table")
    p.add_argument("--fan", type=int, default=3, help="first drafts of the head's fan")
    p.add_argument("--ngram", type=int, default=4, help="tokens of the prompt-lookup branch")
    p.add_argument("--extend-len", type=int, default=2, help="tokens continuing the best first draft")
    p.add_argument("--chat-dir", default=None, help="prepared dataset whose held-out chats join the prompts")
    p.add_argument("--jsonl", default=None, help="prompts from a JSONL file instead of the default subset")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()

    target = load_target(args.target, dtype="float32", device="cpu")
    pack_cpu_linears(target.model)
    use_grouped_attention(target.model)
    if args.jsonl:
        spec = BenchmarkSpec(mtbench_per_category=0, humaneval=0, chat=0, jsonl=args.jsonl)
    else:
        spec = BenchmarkSpec(mtbench_per_category=1, mtbench_turns=(1,), humaneval=2, chat=2, chat_dir=args.chat_dir)
    evals = load_benchmarks(spec)
    prompts = [encode(e, target.tokenizer, {}) for e in evals]
    table = load_ngram_table(args.table, target, exclude_ids=scored_chat_ids(evals))
    model = Eagle3Model.from_pretrained(args.head).eval().attach(target)
    pack_like(model, target.model)
    runner, eos = TargetRunner(target.model), eos_token_ids(target)

    def hybrid(extend: int):
        return PromptLookupBranch(EagleDrafter(model, TreeShape.fan(args.fan), "eagle3"), args.ngram, table=table,
                                  extend=extend, extend_len=args.extend_len)

    drafters = {"plain": None, "branch": hybrid(0), "branch+table": hybrid(1)}
    for d in drafters.values():  # warm-up
        speculative_generate(runner, d, [prompts[0]], 8, 0.0, "greedy", eos)
    time = {k: 0.0 for k in drafters}
    emitted = {k: 0 for k in drafters}
    steps = {k: 0 for k in drafters}
    for n in range(args.passes):
        for i, prompt in enumerate(prompts):
            spec_names = ["branch", "branch+table"] if (i + n) % 2 == 0 else ["branch+table", "branch"]
            ref = None
            for name in ["plain", *spec_names]:
                res = speculative_generate(runner, drafters[name], [prompt], args.new_tokens, 0.0, "greedy", eos)
                ref = res.tokens[0] if ref is None else ref
                if res.tokens[0] != ref:
                    raise SystemExit(f"{name} changed the greedy output of prompt {evals[i].id}")
                time[name] += res.wall_time - res.prefill_time
                emitted[name] += len(res.tokens[0])
                steps[name] += res.stats[0].steps
        print(json.dumps({"pass": n + 1, "prompts": len(prompts), "table_ngrams": len(table),
                          "speedup": {k: round(time["plain"] / time[k], 3) for k in drafters if k != "plain"},
                          "tau": {k: round(emitted[k] / steps[k], 3) for k in drafters if k != "plain"}}), flush=True)


if __name__ == "__main__":
    main()
