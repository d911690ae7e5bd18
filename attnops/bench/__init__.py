"""attnops' benchmark suite, installed with the package so that `python -m attnops bench`, `tune` and `serve-bench`
run anywhere: the shape grids (grid.py), the peers called directly (peers.py), the suite (run.py), the dispatch
tuner (tune.py) and the serving benchmark (serve.py). docs/bench.md is the protocol."""


def require_matplotlib(plot_path) -> None:
    """Fails before any measuring when a plot is asked for (--plot) and matplotlib is missing: a grid that ran for
    minutes should not end in an ImportError."""
    if not plot_path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"--plot {plot_path}: needs matplotlib (pip install matplotlib, or the [bench] extra); "
                         "nothing was run") from None
