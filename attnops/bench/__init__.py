"""attnops' benchmark suite, installed with the package so that `python -m attnops bench`, `tune` and `serve-bench`
run anywhere: the shape grids (grid.py), the peers called directly (peers.py), the suite (run.py), the dispatch
tuner (tune.py) and the serving benchmark (serve.py). docs/bench.md is the protocol."""
