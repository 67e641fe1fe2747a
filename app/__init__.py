"""The HTTP edge: settings, OpenAI-compatible routes, health probes and the CLI."""
