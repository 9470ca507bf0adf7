"""What the tests share: fixture checkpoints (factories, fixture_training), one-request references, the server process and its test-only hooks, a test-only fourth task."""
