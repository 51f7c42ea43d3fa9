"""Peers harness: peer methods trained and evaluated on exactly our scenes, splits and metrics (bench/README.md
"Peers harness"). ``python -m bench.peers.run --help``."""
