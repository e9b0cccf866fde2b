"""Shared by the tree tests (tests/test_tree_engine.py, tests/test_tp_trees.py): plain greedy
outputs of a tiny model and the oracle's references, ``k`` tokens longer than the outputs so an
oracle step near the end still has drafts."""

from __future__ import annotations

from speculant import LLM, SamplingParams


def tokens(outs) -> list[list[int]]:
    """Each RequestOutput's generated token ids."""
    return [o.outputs[0].token_ids for o in outs]


def greedy_with_references(model: str, prompts: list[list[int]], max_tokens: int, k: int
                           ) -> tuple[list[list[int]], list[dict]]:
    """(plain greedy outputs of ``max_tokens``, oracle references of ``max_tokens + k``)."""
    llm = LLM(model=model, skip_tokenizer_init=True, max_num_seqs=8)
    long = tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens + k,
                                                       ignore_eos=True), use_tqdm=False))
    refs = [{"prompt_token_ids": p, "output_token_ids": t} for p, t in zip(prompts, long)]
    return [t[:max_tokens] for t in long], refs
