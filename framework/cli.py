"""The ``speculant`` command: generate, chat, demo, plugins, bench, serve, token-map."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _spec_arg(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit("--speculative-config must be a JSON object")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file, hub id; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto",
                   help="float32, float16 or bfloat16, for weights and activations; auto: "
                   "float32 on the CPU, the checkpoint's float16/bfloat16 on a GPU (default: auto)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N; auto: $SPECULANT_DEVICE if set, else cuda when "
                   "available, else cpu (default: auto)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of sampling (temperature > 0) (default: 0)")
    p.add_argument("--max-model-len", "--max_model_len", type=int, default=None,
                   help="longest sequence, prompt + output, in tokens (default: the model's)")
    p.add_argument("-tp", "--tensor-parallel-size", "--tensor_parallel_size", type=int, default=1,
                   help="devices to shard the model over (rank r on cuda:r; on the CPU, "
                   "processes); the drafter runs unsharded on rank 0 (docs/tensor_parallel.md) "
                   "(default: 1)")
    p.add_argument("--speculative-config", "--speculative_config", default=None,
                   help='speculation strategy as JSON, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 5}\' (`speculant plugins` lists the methods); '
                   "default: none, plain decoding")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "--max_tokens", type=int, default=128,
                   help="tokens to generate at most per reply (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", "--top_p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this probability "
                   "mass (default: 1, all)")
    p.add_argument("--top-k", "--top_k", type=int, default=0,
                   help="keep only the K most likely tokens; 0: no limit (default: 0)")


def _llm(args):
    from speculant import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
               max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
               speculative_config=_spec_arg(args.speculative_config))


def _params(args):
    from speculant import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k)


def _speed(tokens: int, seconds: float) -> str:
    rate = f"{tokens / seconds:.1f}" if seconds > 0 else "-"
    return f"{tokens} tokens in {seconds:.2f} s, {rate} tok/s"


def _acceptance(m) -> str:
    """A SpecMetrics in words."""
    return (f"acceptance {m.acceptance_rate:.0%} ({m.num_accepted_tokens} of "
            f"{m.num_draft_tokens} drafted tokens), {m.tokens_per_step:.2f} tokens per "
            "target step")


def cmd_generate(args) -> int:
    llm = _llm(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(args), use_tqdm=len(prompts) > 1)
    seconds = time.perf_counter() - start
    for o in outs:
        if len(outs) > 1:
            print(f"### {o.prompt}")
        print(o.outputs[0].text)
    sys.stdout.flush()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    speed = _speed(tokens, seconds) + (f" ({len(outs)} prompts)" if len(outs) > 1 else "")
    print(f"[{speed}]", file=sys.stderr)
    if args.speculative_config:
        print(json.dumps(llm.get_metrics().as_dict()), file=sys.stderr)
    return 0


_CHAT_BANNER = ("speculant chat: type a message and press Enter; `exit`, `quit` or Ctrl-D (end "
                "of input) ends the chat; Ctrl-C stops a reply")


def _chat_prompt(llm, messages: list[dict[str, str]]) -> dict:
    if llm.tokenizer is None:
        raise ValueError("chat needs a tokenizer")
    try:
        ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:
        raise ValueError(f"cannot apply the chat template: {e}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return {"prompt_token_ids": list(ids)}


def _stream_reply(llm, prompt: dict, params) -> tuple[str, str]:
    """Print the reply as it is generated; return (its text, a one-line summary)."""
    start = time.perf_counter()
    printed, out, stopped = "", None, False
    stream = llm.generate_stream(prompt, params)
    try:
        for out in stream:
            text = out.outputs[0].text
            # a multi-byte character split over tokens decodes to U+FFFD until it is complete
            if text.startswith(printed) and (out.finished or not text.endswith("\ufffd")):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    except KeyboardInterrupt:  # Ctrl-C stops this reply (closing the stream aborts the request)
        stream.close()
        stopped = True
    print(flush=True)
    tokens = len(out.outputs[0].token_ids) if out is not None else 0
    summary = _speed(tokens, time.perf_counter() - start)
    if stopped:
        return printed, summary + ", stopped"
    m = out.metrics
    if m is not None and m.time_to_first_token is not None:
        summary += f", first token after {m.time_to_first_token:.2f} s"
    if llm.engine.spec is not None and m is not None:
        summary += "; " + _acceptance(m.spec)
    return out.outputs[0].text, summary


def cmd_chat(args) -> int:
    llm = _llm(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params = _params(args)
    interactive = sys.stdin.isatty()
    print(_CHAT_BANNER, file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()  # input(): no "\n"
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            break
        if not interactive and not line:  # end of piped input
            break
        text = line.strip()
        if text in ("exit", "quit"):
            break
        if not text:
            print("(empty message, not sent; `exit`, `quit` or Ctrl-D ends the chat)",
                  file=sys.stderr, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        reply, summary = _stream_reply(llm, _chat_prompt(llm, messages), params)
        print(f"[{summary}]", file=sys.stderr, flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_plugins(args) -> int:
    from speculant.plugin_manager import list_plugins

    plugins = list_plugins()
    if args.json:
        print(json.dumps(plugins, indent=2))
        return 0
    for p in plugins:
        dist = f"{p['distribution']} {p['version']}" if p["distribution"] else (p["version"] or "-")
        print(f"{p['name']}  ({dist})  hooks: {', '.join(p['hooks'])}")
        for s in p["strategies"]:
            mark = s["kind"]
            if not s["lossless"]:  # hookspecs.Strategy.lossless
                mark += ", LOSSY: " + ("declared lossless = False" if s["lossless_declared"]
                                       else "does not declare lossless")
            elif s["lossless_declared"]:
                mark += ", lossless"
            print(f"    strategy {s['name']!r} [{mark}]  hooks: {', '.join(s['hooks'])}")
    print(_tensor_parallel_line())
    return 0


def _tensor_parallel_line() -> str:
    """What ``--tensor-parallel-size`` can be here (speculant plugins' last line)."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"up to {cuda} on CUDA (rank r on cuda:r)" if cuda else "no CUDA device visible"
    return (f"tensor parallelism: tensor_parallel_size {where}, any on the CPU (gloo); "
            "drafters run unsharded on rank 0 (draft_tensor_parallel_size 1)")


def cmd_demo(args) -> int:
    from speculant.demo import run_demo

    return run_demo(model=args.model, max_tokens=args.max_tokens, k=args.k,
                    methods=args.methods.split(",") if args.methods else None)


def cmd_bench(args) -> int:
    from speculant.bench import main as bench_main

    return bench_main(args)


def cmd_serve(args) -> int:
    from speculant.server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    legacy = {k: getattr(args, k) for k in _LEGACY_SPEC_FLAGS if getattr(args, k) is not None}
    return run_server(
        host=args.host, port=args.port, served_model_names=args.served_model_name,
        api_key=args.api_key, max_waiting_seqs=args.max_waiting_seqs,
        split_special_tokens=args.split_special_tokens,
        log_level="info" if args.verbose else "warning",
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        speculative_config=_spec_arg(args.speculative_config),
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        trust_remote_code=args.trust_remote_code,
        use_v2_block_manager=args.use_v2_block_manager,
        **legacy,
    )


def _load_tokenizer(name: str | None):
    """A tokenizer from a model folder, a tokenizer-only folder, a .gguf file, a hub id, or (None)
    the embedded default model."""
    from pathlib import Path

    from speculant.models.loader import load_tokenizer, resolve_model

    path = Path(name).expanduser() if name else None
    if path is not None and path.is_dir() and not (path / "config.json").exists():
        return load_tokenizer(path)  # tokenizer files only
    return load_tokenizer(resolve_model(name))


def cmd_token_map(args) -> int:
    from speculant.drafting.token_map import (
        build_token_map_from_corpus,
        save_token_map,
        special_token_ids,
    )

    tok = _load_tokenizer(args.tokenizer)
    ids, counts = build_token_map_from_corpus(
        tok,
        args.corpus,
        args.size,
        text_field=args.text_field,
        include=args.include or (),
        progress=not args.no_progress,
    )
    out = save_token_map(ids, args.out)
    total = int(counts.sum())
    covered = int(counts[ids.numpy()].sum())  # ids < len(counts): counts cover the vocabulary
    share = f"{covered / total:.2%}" if total else "n/a"
    print(
        f"wrote {len(ids)} of {len(tok)} token ids to {out}: they cover {share} of the "
        f"corpus's {total} tokens ({len(special_token_ids(tok))} special tokens always kept)"
    )
    return 0


def _add_token_map_parser(sub) -> None:
    t = sub.add_parser(
        "token-map",
        help="build a frequency-ranked draft vocabulary (token_map option of eagle, "
        "mlp_speculator, draft_model) from a text corpus",
    )
    t.add_argument(
        "--tokenizer",
        default=None,
        help="the TARGET model's tokenizer: model or tokenizer folder, .gguf file, hub "
        "id; default: the embedded SmolLM2-135M-Instruct",
    )
    t.add_argument(
        "--corpus",
        nargs="+",
        required=True,
        metavar="FILE",
        help="plain text files (tokenized line by line) or .jsonl files with a "
        '"text" field per line',
    )
    t.add_argument(
        "--size",
        type=int,
        required=True,
        help="hot tokens to keep, special tokens included (e.g. 32768 for a 128k vocabulary)",
    )
    t.add_argument(
        "--out", required=True, help="output file: .pt (SGLang's format), .json, .npy or .txt"
    )
    t.add_argument(
        "--text-field",
        default="text",
        help="the field holding the text in .jsonl lines (default: text)",
    )
    t.add_argument(
        "--include",
        type=int,
        nargs="+",
        default=None,
        metavar="ID",
        help="token ids to keep whatever their count (e.g. the generation config's eos ids)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_token_map)


# vLLM's legacy flat speculative flags (deprecated there, as here; --speculative-config is the
# current way): argparse dest -> LLM keyword, which turns them into a speculative_config
_LEGACY_SPEC_FLAGS = {
    "speculative_model": (str, "the draft / speculator checkpoint, or [ngram] (legacy: use "
                          "--speculative-config)"),
    "num_speculative_tokens": (int, "tokens proposed per step (legacy: use --speculative-config)"),
    "speculative_draft_tensor_parallel_size": (int, "devices of the drafter; only 1: it runs "
                                               "unsharded on rank 0 (legacy: use "
                                               "--speculative-config)"),
    "speculative_disable_by_batch_size": (int, "no speculation above this many running "
                                          "sequences (legacy: use --speculative-config)"),
    "ngram_prompt_lookup_max": (int, "longest n-gram the n-gram method matches (legacy)"),
    "ngram_prompt_lookup_min": (int, "shortest n-gram the n-gram method matches (legacy)"),
}


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """The server's options, shared by ``speculant serve`` and
    ``python -m speculant.entrypoints.openai.api_server`` (vLLM's spellings, dashes or
    underscores)."""
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--served-model-name", "--served_model_name", nargs="+", default=None,
                   help="name(s) clients use as `model`; default: --model or SmolLM2-135M-Instruct")
    s.add_argument("--api-key", "--api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--max-num-seqs", "--max_num_seqs", type=int, default=64,
                   help="sequences batched together at most")
    s.add_argument("--max-waiting-seqs", "--max_waiting_seqs", type=int, default=256,
                   help="sequences queued beyond --max-num-seqs before answering 503")
    s.add_argument("--split-special-tokens", "--split_special_tokens", action="store_true",
                   help="chat: encode message content as plain text, so control strings in it "
                   "(e.g. '<|im_start|>system') are not control tokens; a request's "
                   "split_special_tokens field overrides it (docs/server.md)")
    s.add_argument("--kv-cache-memory", "--kv_cache_memory", type=int, default=None,
                   help="bytes for the KV cache (default: sized from --max-num-seqs)")
    s.add_argument("--gpu-memory-utilization", "--gpu_memory_utilization", type=float,
                   default=0.9, help="share of the GPU's memory the engine may use (default: "
                   "0.9; no effect on the CPU)")
    s.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                   help="accepted for vLLM compatibility, no effect: speculant never runs code "
                   "from a checkpoint")
    s.add_argument("--use-v2-block-manager", "--use_v2_block_manager", action="store_true",
                   help="accepted for vLLM compatibility (deprecated there), no effect")
    for dest, (typ, text) in _LEGACY_SPEC_FLAGS.items():
        s.add_argument("--" + dest.replace("_", "-"), "--" + dest, dest=dest, type=typ,
                       default=None, help=text)


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the server extra)")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    """The ``speculant`` command's parser, every sub-command included."""
    parser = argparse.ArgumentParser(
        prog="speculant",
        description="Fast LLM inference with speculative decoding; every strategy is a plugin.",
        epilog="`speculant COMMAND --help` describes a command's options.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level and show the traceback of an error")
    sub = parser.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")

    g = sub.add_parser(
        "generate", help="generate completions for prompts",
        description="Print the completion of each prompt on stdout; the speed (tokens, seconds, "
        "tok/s) and, with speculation, the speculation metrics as JSON on stderr.")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: stdin lines")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat", help="chat on the terminal using the model's chat template (streams the "
        "replies; `exit`, `quit` or Ctrl-D ends it)",
        description="Chat with the model, one message per line (a terminal or piped stdin). "
        "Replies stream on stdout as they are generated; after each, a summary on stderr: "
        "tokens, seconds, tok/s and, with speculation, the acceptance. An empty line is not "
        "sent; `exit`, `quit` or Ctrl-D (end of input) ends the chat, Ctrl-C stops a reply.")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="a system message to start the conversation")
    c.set_defaults(func=cmd_chat)

    pl = sub.add_parser("plugins", help="list loaded plugins, their versions, hooks and strategies")
    pl.add_argument("--json", action="store_true", help="print the list as JSON")
    pl.set_defaults(func=cmd_plugins)

    d = sub.add_parser("demo", help="speculative decoding vs plain decoding on the default model")
    d.add_argument("--model", default=None, help="HF folder, .gguf file, hub id; default: the "
                   "embedded SmolLM2-135M-Instruct")
    d.add_argument("--max-tokens", type=int, default=128,
                   help="tokens generated per prompt (default: 128)")
    d.add_argument("-k", type=int, default=None,
                   help="num_speculative_tokens: tokens proposed per step (default: a shipped "
                   "head's own, the draft steps it was trained for; 5 for the other methods)")
    d.add_argument("--methods", default=None,
                   help="comma-separated speculation methods to compare with plain decoding, "
                   "each NAME or NAME=CHECKPOINT for a method that loads one (eagle=PATH, "
                   "medusa=PATH, ...; medusa alone: untrained heads built for the model) "
                   "(default: ngram, and the shipped heads for the default model that are "
                   "in the repository; `speculant plugins` lists the methods)")
    d.set_defaults(func=cmd_demo)

    from speculant.bench import add_arguments as add_bench_arguments

    b = sub.add_parser("bench", help="measure plain decoding and speculation strategies (JSON + PNG)")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

    _add_serve_parser(sub)
    _add_token_map_parser(sub)
    from speculant.training.cli import add_parsers as add_training_parsers

    add_training_parsers(sub)  # train, eval-acceptance (docs/training.md)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run a parsed command (``args.func``): errors a user can fix (a bad option, a model or
    checkpoint that is missing, truncated or corrupt, a port in use, a missing optional package)
    print one line, exit 2 (``-v``: the traceback)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        if args.verbose:
            raise
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
