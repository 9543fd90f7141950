"""Research drivers, not part of the library: each is run from a checkout as `python -m experiments.NAME`
and writes its results under runs/ (the figures worth keeping go to docs/).

ablation.py  the drafter lever ablation: one head per lever, diagnostic and Spec-Bench tau
sweep.py     training levers over cached features, each head benched on Spec-Bench
diagnose.py  a head's acceptance at draft starts on held-out prompts
kernels.py   one target's forward cost T(M) in several numerics
"""
