"""Shipped speculation heads: trained heads kept in this repository under a name, so
``speculative_config={"method": "eagle", "model": "smollm2-eagle"}`` loads one without a path.

A name resolves to ``spec_registry/heads/<name>/`` when that folder holds the checkpoint
(``config.json``); before the head is trained it is an error that names the one command that
trains and installs it (``speculant train ... --recipe <name>``, docs/training.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent / "heads"


@dataclass(frozen=True)
class ShippedHead:
    name: str  # what ``speculative_config["model"]`` names
    method: str  # the ``speculative_config`` method that loads it
    target: str  # the target model it was trained for ("default": the embedded SmolLM2)
    recipe: str  # the training recipe (speculant.training.recipes) that produces it
    # its recipe's draft steps (head option ``steps``): what ``speculant demo`` runs it with
    num_speculative_tokens: int = 4
    # the prompt lookup ``speculant demo`` runs it with (the strategy's option of that name;
    # None: the head alone): copies of the prompt come from lookup, the rest from the head
    prompt_lookup_min: int | None = 2
    # the confidence stop ``speculant demo`` runs it with (the option of that name; None: every
    # chain drafts num_speculative_tokens): a chain ends where the head is unsure
    confidence_stop: float | None = 0.25

    @property
    def demo_options(self) -> dict:
        """The ``speculative_config`` options ``speculant demo`` adds for this head."""
        out: dict = {"num_speculative_tokens": self.num_speculative_tokens}
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
        if self.confidence_stop is not None:
            out["confidence_stop"] = self.confidence_stop
        return out

    @property
    def folder(self) -> Path:
        return HEADS_DIR / self.name

    @property
    def available(self) -> bool:
        return (self.folder / "config.json").is_file()

    @property
    def train_command(self) -> str:
        return (f"speculant train {self.method} --model {self.target} --recipe {self.recipe} "
                f"--out runs/{self.name}")


SHIPPED: dict[str, ShippedHead] = {
    "smollm2-eagle": ShippedHead("smollm2-eagle", "eagle", "default", "smollm2-eagle"),
}


def available_heads() -> list[ShippedHead]:
    """The shipped heads whose checkpoint is in the repository."""
    return [h for h in SHIPPED.values() if h.available]


def resolve_shipped(model: str, method: str | None) -> ShippedHead | None:
    """The shipped head named ``model`` (None when ``model`` is not such a name, or is an
    existing local path). Raises ValueError when it is not trained yet, or ``method`` is not
    the one that loads it."""
    head = SHIPPED.get(model)
    if head is None or Path(model).exists():
        return None
    if method is not None and method != head.method:
        raise ValueError(f"speculative model {model!r} is a shipped {head.method!r} head; use "
                         f"method {head.method!r} (or leave method out)")
    if not head.available:
        raise ValueError(
            f"speculative model {model!r} names a shipped head that is not in this repository "
            f"yet ({head.folder} has no config.json). Train and install it with: "
            f"{head.train_command} (about 2 hours on a 2-core CPU; docs/training.md)")
    return head


__all__ = ["HEADS_DIR", "SHIPPED", "ShippedHead", "available_heads", "resolve_shipped"]
