"""The knob vocabulary: one description per method config of the fields the tools vary.

A method config names its knobs once (`KnobSpace`, the config class's `KNOBS`), and everything
that enumerates configs derives from that description:

- `config="auto"`'s candidates (`KnobSpace.grid` over each knob's `auto` values, once with the
  config's default switches and once per `Variant`: mechanisms off, so that where they cost
  more than they bring, auto picks the method without them rather than vanilla);
- `ouroboros-jax tune`'s one-knob-at-a-time search (the `tune` values and `start`; `--quick`
  uses `quick` / `quick_start`);
- `recipe_of`, the evaluable `Config(field=value, ...)` string that tune prints and
  `stats["auto"]` reports;
- the paper's Table 4 ablation steps (`KnobSpace.ablation_steps`, from the mechanism switches).

Two rules tie knobs together, stated once here: G = W (as many pool guesses as window columns,
the paper's setting; `tied_to`) and X <= W (never more suffix branches than window columns;
`at_most`). A grid drops the points that break `at_most`; `make` (what tune builds from a point)
clamps them instead, so tune's search may name any value on its axes.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Knob:
    """One integer field of a method config that the tools vary.

    Attributes:
        field: the config field.
        auto: values `config="auto"` searches (empty for a tied knob).
        tune: values `ouroboros-jax tune` tries (the paper's Algorithm 1 grid).
        start: tune's value for this knob before it is chosen.
        quick, quick_start: the same for `tune --quick` (tiny models, seconds).
        tied_to: this field always equals that one's (G = W); it is never searched itself.
        at_most: this field never exceeds that one's (X <= W).
    """

    field: str
    auto: tuple = ()
    tune: tuple = ()
    start: Optional[int] = None
    quick: tuple = ()
    quick_start: Optional[int] = None
    tied_to: Optional[str] = None
    at_most: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Switch:
    """A mechanism switch (a bool config field), in the order Table 4 adds mechanisms."""

    field: str
    label: str


# The shared vocabulary: a knob means the same and takes the same values in every method.
# auto's chains reach 16: on short constrained answers (JSON objects of ~30 tokens) the real
# pair keeps nearly every token of a whole chain, and a chain of 16 measured 1.66x constrained
# vanilla where 8 measured 1.43x and 12 1.51x (docs/structured.md, stop 65)
GAMMA = Knob("gamma", auto=(1, 2, 3, 4, 6, 8, 10, 12, 16), tune=(4, 8, 12), start=8,
             quick=(2, 4), quick_start=4)
WINDOW = Knob("window", auto=(2, 4, 8, 15, 20), tune=(8, 15, 20), start=15, quick=(4,),
              quick_start=4)
NGRAM = Knob("ngram", auto=(3, 4, 5, 7), tune=(5, 6, 7, 8), start=6, quick=(4,),
             quick_start=4)
GUESSES = Knob("guesses", tied_to="window")
SUFFIXES = Knob("suffixes", auto=(1, 2, 3), tune=(1, 3, 5), start=3, quick=(1, 2),
                quick_start=2, at_most="window")
# a switch shared by the pool-keeping methods (lookahead, Ouroboros): the prompt's n-grams
# enter the pool when a row starts (`pool.insert_context`)
CONTEXT_PHRASES = Switch("context_phrases", "context phrases")
# prompt lookup's: candidates copied from the context per round, tokens per candidate
CANDIDATES = Knob("candidates", auto=(1, 2, 3), tune=(1, 2, 3), start=2, quick=(1, 2),
                  quick_start=2)
LENGTH = Knob("length", auto=(2, 4, 6, 8, 12), tune=(4, 8, 12), start=8, quick=(2, 4),
              quick_start=4)


@dataclasses.dataclass(frozen=True)
class Variant:
    """Switch settings `config="auto"` also searches (besides the config's defaults), and the
    knobs they leave idle, searched at one value only (`pinned`: field -> value; a knob the
    switches make irrelevant to the cost model would only add duplicate candidates).

    Ouroboros with its mechanisms off is speculative decoding (the ablation's "SD" step); on a
    device where a wider forward costs much more than a 1-token one (a CPU), phrase drafting
    and lengthening can cost more than they bring, and then that is the fastest Ouroboros.
    """

    switches: dict
    pinned: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KnobSpace:
    """A method config's knobs (in search order) and mechanism switches.

    Attributes:
        knobs: the integer knobs, searched and tied, in the order recipes name them.
        switches: mechanism switches in ablation order (empty: no ablation).
        baseline: the label of the ablation step with every switch off.
        variants: `Variant`s config="auto" searches besides the default switches.
        extras: other config fields a variant may set (not ablation steps: Ouroboros' free
            drafts and their threshold), named in recipes where they differ from the default.
    """

    knobs: tuple
    switches: tuple = ()
    baseline: str = "SD"
    variants: tuple = ()
    extras: tuple = ()

    @property
    def searched(self) -> tuple:
        """The knobs a search varies (tied ones follow their leader), in search order."""
        return tuple(k for k in self.knobs if k.tied_to is None)

    def values(self, which: str) -> dict:
        """{field: values} of the searched knobs for "auto", "tune" or "quick"."""
        return {k.field: tuple(getattr(k, which)) for k in self.searched}

    def starts(self, quick: bool = False) -> dict:
        """{field: tune's starting value} of the searched knobs."""
        return {k.field: k.quick_start if quick else k.start for k in self.searched}

    def make(self, cfg_type, point: dict, **fixed):
        """cfg_type(**point) with the tie rules applied: tied knobs copied from their leader,
        `at_most` knobs clamped to theirs; `fixed` fields passed as given."""
        kw = {k.field: point[k.field] for k in self.searched}
        for k in self.knobs:
            if k.tied_to is not None:
                kw[k.field] = kw[k.tied_to]
        for k in self.searched:
            if k.at_most is not None:
                kw[k.field] = min(kw[k.field], kw[k.at_most])
        return cfg_type(**kw, **fixed)

    def grid(self, cfg_type, values: Optional[dict] = None, fixed: Optional[dict] = None
             ) -> list:
        """Every config over the product of the searched knobs' values (`values`, default each
        knob's `auto`), in knob order, dropping points that break an `at_most` rule; `fixed`
        fields (switches) passed to every config as given."""
        values = {**self.values("auto"), **(values or {})}
        fields = [k.field for k in self.searched]
        out = []
        for combo in itertools.product(*(values[f] for f in fields)):
            point = dict(zip(fields, combo))
            if all(k.at_most is None or point[k.field] <= point[k.at_most]
                   for k in self.searched):
                out.append(self.make(cfg_type, point, **(fixed or {})))
        return out

    def auto_grid(self, cfg_type, values: Optional[dict] = None) -> list:
        """config="auto"'s candidates: the grid with the default switches, then each variant's
        grid (its switches fixed, its idle knobs at their pinned value)."""
        out = self.grid(cfg_type, values)
        full = {**self.values("auto"), **(values or {})}
        for v in self.variants:
            pinned = {f: (x,) for f, x in v.pinned.items()}
            out += self.grid(cfg_type, {**full, **pinned}, fixed=v.switches)
        return out

    def recipe(self, cfg) -> str:
        """`Config(field=value, ...)` over the knobs and the switches that differ from the
        config's defaults, evaluable back into cfg."""
        fields = {f.name: f for f in dataclasses.fields(cfg)}
        body = [f"{k.field}={getattr(cfg, k.field)}" for k in self.knobs]
        body += [f"{s.field}={getattr(cfg, s.field)}" for s in self.switches
                 if getattr(cfg, s.field) != fields[s.field].default]
        body += [f"{f}={getattr(cfg, f)}" for f in self.extras
                 if getattr(cfg, f) != fields[f].default]
        return f"{type(cfg).__name__}({', '.join(body)})"

    def ablation_steps(self) -> tuple:
        """((label, {switch: bool}), ...): every switch off, then one more on per step (paper
        Table 4)."""
        steps = []
        for i in range(len(self.switches) + 1):
            on = {s.field: j < i for j, s in enumerate(self.switches)}
            steps.append((self.baseline if i == 0 else f"+{self.switches[i - 1].label}", on))
        return tuple(steps)


def recipe_of(cfg) -> str:
    """`Config(field=value, ...)` over a method config's knobs (its class's `KNOBS`), evaluable
    back into cfg (what `tune` prints and `stats["auto"]` reports)."""
    return type(cfg).KNOBS.recipe(cfg)
