"""The request path from an admitted request to the replica's answer relayed to the client.

``forward`` places the request (admission, re-placement when a replica refuses it as
overloaded), runs the exchange in the handler's task and stops it at shutdown; ``relay`` relays
the answer, whole or event by event; ``headers`` says which headers cross each way;
``disconnects`` notices a client that went away; ``exchange`` is the state they share.
"""
