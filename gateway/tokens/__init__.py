"""Prompt tokens counted with the model's own tokenizer, when Sluice has it.

``files``: where a model's ``tokenizer.json`` is (a configured path, or the local Hugging Face
cache; never downloaded). ``template``: the chat template beside it, rendered as vLLM renders a
chat. ``counter``: a request's prompt counted with them. ``live``: per model,
the tokenizer found and loaded off the event loop, following reloads; admission's sizing
(``gateway.admission.sizing``) asks it first and estimates only when it has no tokenizer.
"""
