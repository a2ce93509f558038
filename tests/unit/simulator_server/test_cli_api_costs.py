"""The emulator's ``--api-*`` flags: each replaces one of the profile's API-server costs."""

from __future__ import annotations

import pytest

from simulator.apiserver import ApiServerCosts
from simulator.cli import _parser, api_server_costs, main
from simulator.profile import load_profile

BASE = load_profile("llama3-8b-h100")


def costs_from(*flags: str, profile_costs: ApiServerCosts | None = None) -> ApiServerCosts:
    profile = BASE if profile_costs is None else BASE.with_api_server(profile_costs)
    return api_server_costs(_parser().parse_args(["--profile", "x", *flags]), profile)


def test_no_flags_keep_the_profiles_costs() -> None:
    assert costs_from() == ApiServerCosts()
    own = ApiServerCosts(per_request_s=0.01, contention="separate")
    assert costs_from(profile_costs=own) == own


def test_each_flag_replaces_one_cost() -> None:
    own = ApiServerCosts(per_request_s=0.01, per_output_token_s=2e-4, contention="separate")
    got = costs_from(
        "--api-per-prompt-token-s",
        "3e-6",
        "--api-per-step-s",
        "6e-4",
        "--api-contention",
        "shared",
        profile_costs=own,
    )
    assert got == ApiServerCosts(
        per_request_s=0.01,
        per_prompt_token_s=3e-6,
        per_output_token_s=2e-4,
        per_step_s=6e-4,
        contention="shared",
    )


def test_negative_cost_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--profile", "llama3-8b-h100", "--port", "0", "--api-per-step-s", "-0.1"]) == 2
    assert "bad --api-* value" in capsys.readouterr().err


def test_unknown_contention_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--profile", "llama3-8b-h100", "--api-contention", "elsewhere"])
    assert caught.value.code == 2
