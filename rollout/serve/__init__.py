"""``rallyrl serve``: any rallyrl engine behind SGLang's HTTP API (and OpenAI's). ``state.py`` holds
what the routes share, ``native_routes.py`` and ``openai_routes.py`` the routes (``generate.py`` and
``generation.py`` how ``/generate`` reads, ends and answers), ``app.py`` wires them; ``processes.py``
starts servers as processes, ``faults.py`` injects faults for tests, ``command.py`` is the command."""
