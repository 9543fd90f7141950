"""Statistics of one chain generation: per level (forwards = phi_i, time) and per link (accepted
length per verification)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinkStats:
    """Verifications of `verifier` over drafts produced by `drafter`."""

    verifier: str
    drafter: str
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification
    drafted: list[int] = field(default_factory=list)  # draft length (a tree: nodes) per verification
    by_rank: dict[str, list[int]] = field(default_factory=dict)  # trees: "depth:rank" -> [accepted, tried]

    def record(self, n_accepted: int, n_drafted: int) -> None:
        self.accepted.append(n_accepted)
        self.drafted.append(n_drafted)

    def record_ranks(self, trials: list[tuple[int, int, bool]]) -> None:
        """A tree verification's tries (runtime.tree_verify.rank_trials): the rate of rank r at depth d is the
        probability that the verifier's token is the r-th candidate there, given ranks below r were not."""
        self.add_ranks({f"{depth}:{rank}": [int(accepted), 1] for depth, rank, accepted in trials})

    def add_ranks(self, by_rank: dict[str, list[int]]) -> None:
        """Add another link's (or verification's) by_rank counts to this one's."""
        for key, (accepted, tried) in by_rank.items():
            cell = self.by_rank.setdefault(key, [0, 0])
            cell[0] += accepted
            cell[1] += tried

    def summary(self) -> dict:
        """Accepted length = accepted drafts + the corrected/bonus token (tokens per verification)."""
        lengths = [a + 1 for a in self.accepted]
        n = len(lengths)
        mean = sum(lengths) / n if n else 0.0
        var = sum((x - mean) ** 2 for x in lengths) / n if n else 0.0
        drafted = sum(self.drafted)
        return {"verifier": self.verifier, "drafter": self.drafter, "verifications": n,
                "mean_accepted_length": mean, "var_accepted_length": var,
                "histogram": counts(lengths),
                "draft_acceptance_rate": sum(self.accepted) / drafted if drafted else None,
                **({"by_rank": dict(sorted(self.by_rank.items()))} if self.by_rank else {})}


@dataclass
class ChainStats:
    new_tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    stop_reason: str = ""
    levels: list[dict] = field(default_factory=list)  # name, forwards, time_s, tokens_fed
    links: list[LinkStats] = field(default_factory=list)
    prompt_shared: bool = False  # the target prefilled first and committed token 1 (links[0]'s first record: no draft)

    @property
    def target_forwards(self) -> int:
        return self.levels[0]["forwards"] if self.levels else 0

    @property
    def tau(self) -> float:
        """New tokens per target forward."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "prompt_tokens": self.prompt_tokens,
                "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s, "tau": self.tau,
                "stop_reason": self.stop_reason, "prompt_shared": self.prompt_shared, "levels": self.levels,
                "links": [link.summary() for link in self.links]}


def counts(values) -> dict[int, int]:
    """value -> how many times it occurs, sorted by value."""
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
