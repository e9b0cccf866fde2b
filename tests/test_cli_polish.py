"""The command line's manners: every option documented, `chat` streams and reports, `generate`
reports its speed, and LLM.generate_stream (what `chat` streams from)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import select
import subprocess
import sys
import time

import pytest

from speculant import LLM, SamplingParams
from speculant.cli import build_parser, main

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'
SPEED = re.compile(r"\[(\d+) tokens in \d+\.\d\d s, (\d+\.\d|-) tok/s")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(model=str(tiny_llama), max_num_seqs=4)


# ----------------------------------------------------------------------------- --help
def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_of_every_command_has_a_help_string():
    parser = build_parser()
    commands = dict(_subparsers(parser))
    assert {"generate", "chat", "plugins", "demo", "bench", "serve", "token-map"} <= set(commands)
    undocumented = []
    for name, p in [("speculant", parser), *commands.items()]:
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = action.help
            if not text or text == argparse.SUPPRESS or not text.strip():
                undocumented.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not undocumented, f"options without a help string: {undocumented}"
    # and every command has a one-line help in `speculant --help`
    listed = {a.dest: a.help for a in parser._subparsers._group_actions[0]._choices_actions}
    assert set(listed) == set(commands) and all(listed.values())


# ----------------------------------------------------------------------------- generate
def test_generate_prints_its_speed_on_stderr(tiny_llama, tiny, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--prompt", "Hello there",
               "--max-tokens", "6"])
    out, err = capsys.readouterr()
    want = tiny.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=6),
                         use_tqdm=False)[0].outputs[0]
    assert rc == 0 and out == want.text + "\n"  # stdout: the completion only
    m = SPEED.search(err)
    assert m, err
    assert int(m.group(1)) == len(want.token_ids)
    assert "{" not in err  # no speculation: no metrics JSON


def test_generate_with_speculation_prints_speed_and_metrics(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--prompt", "a b a b a b a b",
               "--prompt", "Hello", "--max-tokens", "10", "--speculative-config", NGRAM])
    out, err = capsys.readouterr()
    assert rc == 0 and out.count("### ") == 2
    lines = err.strip().splitlines()
    m = SPEED.search(err)
    assert m and int(m.group(1)) > 0 and "(2 prompts)" in err
    metrics = json.loads(lines[-1])  # the metrics stay the last line, as JSON
    assert {"acceptance_rate", "num_draft_tokens", "mean_accepted_length"} <= set(metrics)


# ----------------------------------------------------------------------------- chat
class _Recorder(io.StringIO):
    """stdout that keeps every write apart."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def _chat(monkeypatch, capsys, stdin: str, *args: str):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rec = _Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    rc = main(["chat", *args])
    err = capsys.readouterr().err
    return rc, rec, err


def test_chat_with_piped_stdin_streams_the_reply_and_prints_metrics(
        tiny_llama, tiny, monkeypatch, capsys):
    rc, rec, err = _chat(monkeypatch, capsys, "Hello\n", "--model", str(tiny_llama),
                         "--max-tokens", "8")
    assert rc == 0
    want = tiny.chat([{"role": "user", "content": "Hello"}], GREEDY,
                     use_tqdm=False)[0].outputs[0]
    assert rec.getvalue() == want.text + "\n"
    # streamed: the reply came in several writes, each a continuation of the text so far
    pieces = [w for w in rec.writes if w and w != "\n"]
    assert len(pieces) > 1, rec.writes
    assert "".join(pieces) == want.text
    # the banner says how to quit; one summary line per reply
    assert "exit" in err and "quit" in err and "Ctrl-D" in err
    summaries = SPEED.findall(err)
    assert len(summaries) == 1 and int(summaries[0][0]) == len(want.token_ids)
    assert "first token after" in err and "acceptance" not in err


def test_chat_with_speculation_reports_the_acceptance(tiny_llama, monkeypatch, capsys):
    rc, rec, err = _chat(monkeypatch, capsys, "a b a b a b a b\n", "--model", str(tiny_llama),
                         "--max-tokens", "12", "--speculative-config", NGRAM)
    assert rc == 0 and rec.getvalue().strip()
    assert re.search(r"; acceptance \d+% \(\d+ of \d+ drafted tokens\), \d+\.\d\d tokens per "
                     r"target step\]", err), err


def test_chat_empty_line_is_not_sent_and_does_not_quit(tiny_llama, monkeypatch, capsys):
    rc, rec, err = _chat(monkeypatch, capsys, "\nHello\n   \nHi again\nexit\nnot read\n",
                         "--model", str(tiny_llama), "--max-tokens", "4")
    assert rc == 0
    assert err.count("empty message, not sent") == 2  # with a hint, each time
    assert len(SPEED.findall(err)) == 2  # two replies: Hello, Hi again; nothing after exit
    assert rec.getvalue().count("\n") == 2


def test_chat_ends_at_end_of_input_and_on_quit(tiny_llama, monkeypatch, capsys):
    rc, rec, err = _chat(monkeypatch, capsys, "", "--model", str(tiny_llama))
    assert rc == 0 and rec.getvalue() == "" and not SPEED.search(err)
    rc, rec, err = _chat(monkeypatch, capsys, "quit\nHello\n", "--model", str(tiny_llama))
    assert rc == 0 and rec.getvalue() == "" and not SPEED.search(err)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_chat_on_a_terminal(tiny_llama):
    """On a TTY (input() with a prompt): an empty line gets the hint, the chat goes on, and
    Ctrl-D ends it with status 0."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "speculant.cli", "chat", "--model", str(tiny_llama),
         "--max-tokens", "4"],
        stdin=slave, stdout=slave, stderr=slave, close_fds=True,
    )
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, timeout: float = 120.0) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen:
            left = end - time.monotonic()
            assert left > 0, f"no {marker!r} in {seen.decode(errors='replace')!r}"
            if select.select([master], [], [], left)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break

    try:
        read_until(b"> ")
        os.write(master, b"Hello\n")
        read_until(b"tok/s")
        read_until(b"> ")
        seen = b""
        os.write(master, b"\n")
        read_until(b"empty message, not sent")
        read_until(b"> ")
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


# ----------------------------------------------------------------------------- generate_stream
def test_generate_stream_grows_to_what_generate_returns(tiny):
    want = tiny.generate("Hello there", GREEDY, use_tqdm=False)[0]
    outs = list(tiny.generate_stream("Hello there", GREEDY))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and len(outs) > 1
    for o in outs:
        assert want.outputs[0].token_ids[: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids
    last = outs[-1]
    assert last.outputs[0].text == want.outputs[0].text
    assert last.metrics is not None and last.metrics.num_output_tokens == len(want.outputs[0].token_ids)


def test_generate_stream_closed_early_aborts_the_request(tiny):
    stream = tiny.generate_stream("Hello there", SamplingParams(temperature=0.0, max_tokens=50))
    first = next(stream)
    assert not first.finished
    stream.close()
    assert not tiny.engine.requests and not tiny.engine.has_unfinished_requests()
    # the engine carries on
    assert tiny.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_generate_stream_takes_one_prompt(tiny):
    with pytest.raises(ValueError, match="one prompt"):
        next(tiny.generate_stream(["a", "b"]))
