"""The gateway's HTTP surface apart from the proxied routes: middleware, errors, admin, OpenAPI.

``errors`` is the ONE map from a refusal or failure to its status, headers and OpenAI-style
body; ``middleware`` the public application's one middleware layer; ``request_body`` reads a
body in time; ``parse_errors`` answers what aiohttp's parser refuses; ``admin`` serves
``/metrics`` and ``/sluice/v1/*``; ``openapi`` describes the whole surface; ``echo`` clips what a
client sent before it is echoed or logged; ``server_header`` names the server.
"""
