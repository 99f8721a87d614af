"""Generation: the one service (price → shed → admit → route → engine streams → settle + meter) that
chat, completions and batch lines call (``service.run_generation``), what every endpoint decides
before it (``requests``) and the tokens a generation used (``usage``). Wire formats live with the
endpoints and in ``gateway.openai``; the import contracts keep them out of here."""
