"""``choice``: multiple choice where the reply ends at the first option number, so a shorter path to the answer
exists (issue #35 part 5: the task of ``benchmarks/completion_time_learning.py``).

Episode: system + user ``prompt`` (a question with options ``1)`` .. ``4)`` and "Answer with the number
only."), then one model turn generated token-in/token-out on the job's backend with the request's
``sampling_params`` plus the stop strings ``"1"``, ``"2"``, ``"3"``, ``"4"`` (vLLM's ``stop``: generation ends
with the first token whose text holds an option number; the request's own ``stop`` strings are kept beside
them). Everything the model samples before that digit is generation time spent on no answer: a policy that
names its option at once finishes sooner than one that writes filler first, with the same outcome.

Reward (``outcome``, weight 1): 1.0 when the first option digit (``1``-``4``) in the decoded text of the
generated tokens is the instance's ``answer``, else 0.0 (a wrong option, or none within ``max_tokens``);
``resolved`` is the same bit. Only the first digit counts, so a reply naming every option ("1234") scores only
where the key is ``1``, and the dataset's keys are balanced, so a constant answer scores 1/4. The text is at
most ``max_tokens`` tokens the server generated and decoded itself; it is read with one linear scan for a
digit. Nothing else the policy writes enters the reward.

For the tiny random test model (``prorl_server/dev/tiny_model.py``, vocab 4096, near-uniform over tokens) 2.3%
of the vocabulary's tokens hold an option digit (0.6-0.8% each), so a reply runs about 30 tokens (median)
before it stops, and about a quarter of the replies that stop name the right option.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from prorl_server.llm.conversation import Conversation
from prorl_server.plugin import AgentHandler, NotRegradableError, compose_reward
from prorl_server.types import TokenStats

OPTIONS = "1234"
SYSTEM_PROMPT = "You are a helpful assistant."
_FIRST_OPTION = re.compile(f"[{OPTIONS}]")
#: the dataset's categories and their members (a question asks for the one member of a category among
#: three members of other categories)
CATEGORIES = {
    "fruit": ("apple", "pear", "mango", "kiwi", "banana", "grape"),
    "animal": ("horse", "tiger", "rabbit", "otter", "sparrow", "eagle"),
    "colour": ("red", "green", "blue", "yellow", "purple", "grey"),
    "metal": ("iron", "copper", "silver", "gold", "zinc", "tin"),
    "tool": ("hammer", "saw", "chisel", "wrench", "drill", "spade"),
    "instrument": ("violin", "flute", "drum", "trumpet", "harp", "piano"),
}


class ChoiceInstance(BaseModel):
    """``{"data_source": "choice", "prompt": str, "answer": "1"|"2"|"3"|"4"}``; unknown fields are allowed
    (``instance_id``, a trainer's bookkeeping)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1, max_length=4000, description="the question and its options 1) .. 4)")
    answer: str = Field(pattern=f"^[{OPTIONS}]$", description="the number of the right option")


def first_option(text: str) -> Optional[str]:
    """The first option digit (``1``-``4``) in ``text``, or None."""
    m = _FIRST_OPTION.search(text)
    return m.group() if m else None


def stop_strings(stop: object) -> list[str]:
    """The request's ``stop`` (None, a string or a list of strings, already bounded by the wire model) with
    the option digits added."""
    own = [stop] if isinstance(stop, str) else list(stop or [])
    return own + [c for c in OPTIONS if c not in own]


@dataclass(slots=True)
class ChoiceState:
    """What a ``choice`` job carries between stages (``job.state``)."""

    instance: Optional[ChoiceInstance] = None  # the validated instance (init)


class ChoiceHandler(AgentHandler):
    """See the module docstring. Instance: :class:`ChoiceInstance`."""

    name = "choice"
    needs_llm = True
    instance_model = ChoiceInstance  # a malformed instance is refused at submit (422)
    state_model = ChoiceState

    async def init(self, job) -> None:
        job.state.instance = ChoiceInstance.model_validate(job.instance)

    async def run(self, job) -> None:
        inst: ChoiceInstance = job.state.instance
        if job.llm is None:
            raise RuntimeError("this server has no LLM context")
        backend = await job.backend()
        tokenizer = await job.llm.tokenizer(backend)
        max_len = (await job.llm.client.model_info(backend.address)).max_model_len
        sp = dict(job.sampling_params or {})
        max_tokens = int(sp.pop("max_tokens", 0) or 32)
        sp["stop"] = stop_strings(sp.get("stop"))
        conv = await Conversation.create(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                                                     {"role": "user", "content": inst.prompt}],
                                         max_context_tokens=max_len)
        finish = "length"
        if conv.room >= 1:
            comp = await job.llm.client.complete(conv.token_ids, backend=job, max_tokens=min(max_tokens, conv.room),
                                                 sampling_params=sp)
            conv.add_completion(comp)
            finish = comp.finish_reason or "stop"
        conv.finish(finish)
        job.messages = conv.messages
        job.trajectories = conv.trajectories()
        job.turns = list(conv.turns)
        job.add_token_stats(TokenStats(**conv.token_stats()))
        job.extra["choice"] = {"finish_reason": finish}

    def restore_for_eval(self, job, result) -> None:
        """Eval reads the instance and the recorded messages only."""
        if not isinstance(result.extra.get("choice"), dict):
            raise NotRegradableError("the result has no extra.choice (the record of the model's turn)")
        job.state.instance = ChoiceInstance.model_validate(job.instance)

    async def eval(self, job) -> None:
        inst: ChoiceInstance = job.state.instance
        # the server's decoding of the generated tokens (Conversation.add_completion), not text the backend sent
        reply = next((m.get("content") or "" for m in job.messages if m.get("role") == "assistant"), "")
        option = first_option(reply)
        job.resolved = option == inst.answer
        job.extra.setdefault("choice", {}).update(option=option)
        compose_reward(job, 1.0 if job.resolved else 0.0)


def load_dataset(arg: Optional[str] = None, limit: Optional[int] = None, seed: int = 0) -> list[dict]:
    """``limit`` (default 16) seeded questions "Which of these is a <category>?" with one member of the category
    and three of others; the right option cycles 1, 2, 3, 4 over the instances (balanced keys). ``arg`` is
    unused."""
    rng = random.Random(seed)
    names = sorted(CATEGORIES)
    out = []
    for i in range(limit or 16):
        cat = names[i % len(names)]
        others = rng.sample([m for c in names if c != cat for m in CATEGORIES[c]], 3)
        key = i % len(OPTIONS)
        options = others[:key] + [rng.choice(CATEGORIES[cat])] + others[key:]
        lines = "\n".join(f"{c}) {o}" for c, o in zip(OPTIONS, options))
        out.append({"data_source": "choice", "instance_id": f"choice-{seed}-{i}",
                    "prompt": f"Which of these is a {cat}?\n{lines}\nAnswer with the number only.",
                    "answer": OPTIONS[key]})
    return out
