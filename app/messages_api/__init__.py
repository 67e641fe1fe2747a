"""Anthropic's Messages API (`/v1/messages`): its wire format, and its translation to and from the
chat route's parts, which serve it."""
