"""Agent frameworks people drive chat models with (LangChain, the OpenAI Agents SDK,
instructor), unchanged, against `duet up --tool-parser hermes` on the random tiny model: each
forces a call (the way it asks for one), so the tiny model's call is sampled under the
function's schema and the framework gets arguments it can use. The arguments are enums: a random model fills a free string until max_tokens. What each
test checks is in its docstring."""

import asyncio
import json
from typing import Literal

import pytest
from e2e_helpers import start_cluster
from pydantic import BaseModel, Field

from tinymodel.make import make_tiny_model

CITIES = ["Paris", "Oslo", "Lima"]


class Weather(BaseModel):
    """The weather asked for."""

    city: str = Field(json_schema_extra={"enum": CITIES})
    hot: bool


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("random") / "tiny-model", seed=0)
    args = ["--prefill", "1", "--decode", "1", "--dtype", "float32", "--threads", "1"]
    up = start_cluster([*args, "--model", str(model), "--tool-parser", "hermes"], tmp_path_factory)
    yield up.url + "/v1"
    up.stop()


def test_langchain_bind_tools_gets_a_tool_call(url):
    """LangChain's ChatOpenAI with `bind_tools(..., tool_choice=name)`: the AIMessage carries
    one parsed tool call of that tool, with arguments valid for the pydantic schema."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url, api_key="x", model="tiny-model", temperature=0.0)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


def test_the_agents_sdk_runs_its_tool_and_finishes(url):
    """The OpenAI Agents SDK with a chat-completions model and `tool_choice="required"`: the
    runner calls the Python tool with parsed arguments, sends the result back (the tool
    message through the chat template), and the run ends with a final text output."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return json.dumps({"city": city, "temperature": 18})

    model = OpenAIChatCompletionsModel(
        model="tiny-model", openai_client=AsyncOpenAI(base_url=url, api_key="x")
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=120),
    )
    result = asyncio.run(Runner.run(agent, "Weather in Lima?", max_turns=4))
    assert len(seen) == 1 and seen[0] in CITIES
    assert isinstance(result.final_output, str)


def test_instructor_in_tools_mode_returns_the_pydantic_model(url):
    """instructor in TOOLS mode (`response_model=Weather`): it forces the function named after the
    model, the router samples the call under its schema, and instructor validates the
    arguments into a Weather on the first try (max_retries=1: one attempt, no re-ask)."""
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=url, api_key="x"), mode=instructor.Mode.TOOLS)
    weather = client.chat.completions.create(
        model="tiny-model",
        response_model=Weather,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_retries=1,
        temperature=0.0,
        max_tokens=120,
    )
    assert isinstance(weather, Weather) and weather.city in CITIES
