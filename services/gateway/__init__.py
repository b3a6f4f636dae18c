"""The HTTP gateway's pure building blocks: input hygiene, request policy and API-key auth."""
