"""Prompt tokens counted with the model's own tokenizer, when Sluice has it.

``files``: where a model's ``tokenizer.json`` is (a configured path, or the local Hugging Face
cache; never downloaded). ``counter``: a request's prompt counted with it. ``live``: per model,
the tokenizer found and loaded off the event loop, following reloads; admission's sizing
(``gateway.admission.sizing``) asks it first and estimates only when it has no tokenizer.
"""
