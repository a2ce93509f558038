"""The wire formats Sluice speaks, pure: request shapes, bodies, usage and server-sent events.

``openai`` (the OpenAI routes, and the ``ParsedRequest`` every route becomes), ``responses``
(usage, first tokens and model lists in what a replica answers), ``tgi`` (TGI's native
``/generate`` routes) and ``sse`` (splitting a byte stream into whole events). They parse
and serialise; they hold no state, start no I/O, and know nothing of admission or replicas.
"""
