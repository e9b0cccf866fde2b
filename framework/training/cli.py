"""``speculant train`` and ``speculant eval-acceptance`` (docs/training.md)."""

from __future__ import annotations

import argparse
import json


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object")
    return value


def add_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a speculation head on the target's own greedy "
                       "replies (self-distillation; docs/training.md)")
    t.add_argument("method", help="eagle, eagle3, mlp_speculator or medusa")
    t.add_argument("--model", default=None, help="the target: HF folder, .gguf file, hub id; "
                   "default: the embedded SmolLM2-135M-Instruct")
    t.add_argument("--out", required=True, help="folder of the trained head (and its trainer "
                   "state, history.json, loss.png)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 200)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 1e-3)")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 8)")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 20)")
    t.add_argument("--checkpoint-every", type=int, default=None,
                   help="save the trainer state every N steps (default: 100)")
    t.add_argument("--recipe", default=None,
                   help="a named recipe that fixes every other setting (data, head options, "
                   "schedule; e.g. smollm2-eagle, docs/training.md); a finished run installs "
                   "the head where speculative_config's model finds it by name")
    t.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step (state saved; --resume continues) (default: none)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the trainer state in --out")
    t.add_argument("--num-prompts", type=int, default=None,
                   help="training prompts used (default: all of the train split)")
    t.add_argument("--max-new-tokens", type=int, default=None,
                   help="length of the target's reply to each prompt (default: 128)")
    t.add_argument("--val-prompts", type=int, default=None,
                   help="held-out prompts evaluated every --eval-every steps (default: none)")
    t.add_argument("--eval-every", type=int, default=None,
                   help="steps between held-out evaluations (default: 50)")
    t.add_argument("--cache-dir", default=None,
                   help="where the distilled data is kept (default: OUT/data)")
    t.add_argument("--head-options", default=None,
                   help='JSON of the head\'s options, e.g. \'{"steps": 4}\' for eagle, '
                   '\'{"n_predict": 3}\' for mlp_speculator, \'{"num_heads": 4}\' for medusa')
    t.add_argument("--save-dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="dtype of the written checkpoint (default: float16)")
    t.add_argument("--device", default=None, help="training device (default: cuda if "
                   "available, else cpu)")
    t.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU threads of the hidden-state pass and of training on the CPU "
                   "(default: every available CPU; also with --recipe)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval-acceptance", help="acceptance by position, tokens per target "
                       "forward and speedup of a strategy on held-out prompts (JSON + PNG)")
    e.add_argument("--model", default=None, help="the target (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    e.add_argument("--spec", required=True,
                   help='the speculative_config as JSON, e.g. \'{"method": "eagle", "model": '
                   '"heads/eagle"}\'')
    e.add_argument("--prompts", default="held-out", choices=["held-out", "train"],
                   help="prompt split (default: held-out)")
    e.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per category (default: all)")
    e.add_argument("--max-tokens", type=int, default=128, help="reply length (default: 128)")
    e.add_argument("--out", default="acceptance",
                   help="folder of acceptance.json and acceptance.png (default: ./acceptance)")
    e.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    e.set_defaults(func=cmd_eval_acceptance)


# `speculant train`'s settings that a recipe fixes, with their defaults without one
TUNABLE_DEFAULTS = {"steps": 200, "lr": 1e-3, "batch_size": 8, "warmup": 20,
                    "checkpoint_every": 100, "num_prompts": None, "max_new_tokens": 128,
                    "val_prompts": None, "eval_every": 50, "head_options": "{}",
                    "save_dtype": "float16"}


def cmd_train(args: argparse.Namespace) -> int:
    if args.recipe is not None:
        return _train_recipe(args)
    for key, value in TUNABLE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from speculant.training.api import train

    res = train(args.method, args.out, args.model, num_prompts=args.num_prompts,
                max_new_tokens=args.max_new_tokens, cache_dir=args.cache_dir,
                head_options=_json_object(args.head_options, "--head-options"),
                resume=args.resume, device=args.device, stop_at=args.stop_at,
                val_prompts=args.val_prompts, eval_every=args.eval_every,
                steps=args.steps, lr=args.lr, batch_size=args.batch_size, warmup=args.warmup,
                checkpoint_every=args.checkpoint_every, save_dtype=args.save_dtype,
                cpu_threads=args.cpu_threads)
    last = res.history[-1] if res.history else {}
    print(f"wrote {res.out} after {res.steps} steps ({res.wall_s:.0f} s training): loss "
          f"{last.get('loss', float('nan')):.3f}, top-1 by position {last.get('acc')}; load it "
          f"with speculative_config={{\"method\": \"{args.method}\", \"model\": \"{res.out}\"}}")
    return 0


def _train_recipe(args: argparse.Namespace) -> int:
    from speculant.models.loader import DEFAULT_MODEL_ALIASES
    from speculant.training.recipes import get_recipe, train_recipe

    try:
        recipe = get_recipe(args.recipe)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    fixed = [f"--{k.replace('_', '-')}" for k in TUNABLE_DEFAULTS if getattr(args, k) is not None]
    if fixed:
        raise SystemExit(f"--recipe {recipe.name} fixes {', '.join(fixed)}; leave them out (or "
                         "train without --recipe)")
    if args.method != recipe.method:
        raise SystemExit(f"recipe {recipe.name} trains a {recipe.method!r} head, not "
                         f"{args.method!r}: run `{recipe.command(args.out)}`")
    same = {recipe.target, None, *DEFAULT_MODEL_ALIASES} if recipe.target == "default" else {
        recipe.target}
    if args.model not in same and str(args.model).lower() not in same:
        raise SystemExit(f"recipe {recipe.name} is for --model {recipe.target}, not "
                         f"{args.model!r}")
    print(f"recipe {recipe.name}: {recipe.model_dump_json()}")
    res, installed = train_recipe(recipe.name, args.out, resume=args.resume,
                                  stop_at=args.stop_at, cache_dir=args.cache_dir,
                                  device=args.device, cpu_threads=args.cpu_threads)
    if installed is None:
        print(f"stopped after step {res.steps} of {recipe.train['steps']} ({res.wall_s:.0f} s "
              f"of training so far); continue with: {recipe.command(args.out)} --resume")
    else:
        print(f"trained {res.steps} steps ({res.wall_s:.0f} s); installed {installed}: load it "
              f"with speculative_config={{\"method\": \"{recipe.method}\", \"model\": "
              f"\"{recipe.name}\"}}")
    return 0


def cmd_eval_acceptance(args: argparse.Namespace) -> int:
    from speculant.training.evaluate import eval_acceptance

    eval_acceptance(_json_object(args.spec, "--spec"), args.model, args.prompts,
                    args.num_prompts, args.max_tokens, args.out, args.device)
    print(f"wrote {args.out}/acceptance.json and {args.out}/acceptance.png")
    return 0
