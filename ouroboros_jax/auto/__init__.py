"""`config="auto"`: each method's configuration chosen for the device, models and batch at hand.

A speculative method pays off only where scoring many tokens in one forward costs about what
scoring one costs (an accelerator reading its weights at batch 1), and only as far as the draft
agrees with the target. Both are priced without charging the user's later calls anything:

1. **prices** (`prices`): a forward of n tokens costs t(n) = scale * anchor(n) * shape(n): the
   shape from the model's bytes and FLOPs at the device's calibrated rates, the anchor its
   forwards of 1, 2 and 8 tokens timed once, the scale learned from the user's own calls;
2. **agreement** (`agreement`): realised by the pair's greedy chain calls, by depth where they
   measured it; before that, the draft's and the target's argmax over the prompts;
3. **choice** (`choice`): the cost model's predicted rate (decoding/cost.py) maximised over
   each method's knob grid (decoding/knobs.py), vanilla where nothing is predicted to beat it
   by a margin; a choice kept until another is predicted clearly faster (a new config costs a
   compile);
4. **switch** (`switch`): a changed mind's loop compiled before a call runs it.

All of it is kept in the disk store (`store`: `cache_path()`) and in one `AutoTuner` object
(`tuner`): `generate` uses `default_tuner()`, the serving engine builds its own. The cost model
stays in decoding/cost.py, beside the methods' round models that it prices and that the bench
reads too (the methods describe themselves there and never import auto).

On an accelerator t(n) is nearly flat up to tens or hundreds of tokens, and the choice lands at
large trees (the paper's recipe: gamma ~12, W ~20, N ~7); on a 2-core CPU a forward's cost grows
with every token, and it lands at small trees (what `ouroboros-jax tune` finds there).
"""

from .choice import Choice
from .store import cache_path
from .tuner import AutoTuner, default_tuner, wait_for_background, warming_up

__all__ = ["AutoTuner", "Choice", "cache_path", "default_tuner", "wait_for_background",
           "warming_up"]
