"""What the tests share: fixture checkpoints (factories, fixture_training), one-request references, the server process's
fork server and its test-only hooks, a test-only fourth task. What the benchmarks share with the tests (tokenizers of
tiny checkpoints, a plain server process, the AVX2 launcher) is the package's `tserve.testing`."""
