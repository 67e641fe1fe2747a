"""What the tests share: model and engine builders, reference decoders, cost profiles, servers
and their waits, deployment readers. Plain modules, not tests, so that no test module imports
another and each test module can run alone."""
