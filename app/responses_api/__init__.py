"""OpenAI's Responses API (`/v1/responses`): its wire format, the stored responses, and the
translation to and from the chat route's parts, which serve it."""
