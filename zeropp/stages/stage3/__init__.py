"""ZeRO stage 3's weights, partitioned like the gradients and optimizer state: `param.py` (a
weight's states and a bucket's gather), `weights.py` (the parameter store and the weight
sources a gather reads), `gathers.py` (`WeightGathers`: what to gather when), `hooks.py` (where
a weight is seen used; the planner runs them too). zeropp/build.py composes them."""
