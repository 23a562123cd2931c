"""Operations shared by the CLI, the HTTP API and the client (one place each)."""
