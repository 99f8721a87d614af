"""The OpenAI Agents SDK, unchanged, against the whole platform: its default model class
(``OpenAIResponsesModel``) calls ``/v1/responses``. An agent with a function tool is run to its end:
forced to call the tool first (the engine's constrained decoding makes even a random-weight model call
it with valid arguments), the SDK runs the tool and sends its output back as a ``function_call_output``
item, and the model answers in the agent's output type (structured output: a JSON schema the engine
enforces, so the answer ends by itself; a random model's free text would run to ``max_tokens``, which
the SDK rightly treats as an error). The SDK resets ``tool_choice`` after a tool use, as with OpenAI."""

from __future__ import annotations

import asyncio
from typing import Annotated

import agents
import pydantic
import pytest
from openai import AsyncOpenAI

from tests.e2e.platform_harness import MODEL, PLATFORM_GROUP, Platform

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(PLATFORM_GROUP)]


class Forecast(pydantic.BaseModel):
    summary: str = pydantic.Field(max_length=12)
    sunny: bool


def test_an_agent_calls_its_tool_and_answers(platform: Platform) -> None:
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=10)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    client = AsyncOpenAI(base_url=platform.openai_base_url, api_key=platform.api_key, max_retries=0)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=model,
                         tools=[get_weather], output_type=Forecast, model_settings=agents.ModelSettings(
                             tool_choice="get_weather", max_tokens=200, temperature=0))

    async def run() -> agents.RunResult:
        try:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0]  # the SDK ran the tool once, with the model's argument
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2  # two calls of /v1/responses
