"""The ``shout`` handler: a multi-turn task a tiny random model can learn in minutes on a CPU.

Episode (the model's turns are generated token-in/token-out on the job's backend; every other message is the
environment's, tokenized as a delta and masked out of the loss):

1. system + user: the instance's ``prompt`` (e.g. "Say something about the sea.");
2. assistant turn 1 (``sampling_params.max_tokens`` tokens at most);
3. user (the environment): ``feedback`` (default "Louder! Say it again in capital letters only.");
4. assistant turn 2; steps 3-4 repeat until the model has had ``turns`` turns (default 2).

Reward (:func:`capital_share`, computed from the decoded text of the tokens of the model's **last** turn only):
capital letters / cased letters (``str.isupper`` / (``isupper`` or ``islower``)); 0.0 when that turn has no
cased letter (silence, digits or punctuation are not an answer). ``resolved``: at least
``min_letters`` cased letters, all capitals. For the tiny random test model (vocab 4096, about uniform over
tokens) the reward starts near 0.19 (measured: 0.18 of the vocabulary's cased letters are capitals); a policy
that learns to favour the capital-letter tokens raises it towards 1.0.

What the policy could game: nothing outside its own last turn enters the reward (earlier turns and the
feedback do not), and the reward is a pure function of that text, so the only way up is more capitals and
fewer lower-case letters in it, which is the task.

Reward components (:mod:`prorl_server.rewards`): ``outcome`` is that share, placed on the last turn;
``turn_scores`` (a credit in [0, 1], not a penalty: the mean capital share of the turns that answered the
feedback, each on its own turn; an empty turn scores 0) and ``language_mixing`` are process terms of weight 0
unless the request's ``reward_weights`` names them.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from prorl_server.llm.conversation import Conversation
from prorl_server.plugin import AgentHandler, NotRegradableError
from prorl_server.plugin import LANGUAGE_MIXING, compose_reward, off_loop, process_terms_async, turn_records
from prorl_server.types import RewardComponent, TokenStats

DEFAULT_FEEDBACK = "Louder! Say it again in capital letters only."
SYSTEM_PROMPT = "You are a helpful assistant."
TOPICS = ("the sea", "a mountain", "the city", "a forest", "the weather", "a river", "the night sky", "a garden",
          "the desert", "a storm", "the harbour", "an old bridge", "a train", "the market", "a lighthouse", "snow")


class ShoutInstance(BaseModel):
    """``{"data_source": "shout", "prompt": str, "feedback"?: str, "turns"?: int (2-8), "min_letters"?: int}``;
    unknown fields are allowed (``instance_id``, a trainer's bookkeeping)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1, max_length=4000)
    feedback: str = Field(default=DEFAULT_FEEDBACK, min_length=1, max_length=4000)
    turns: int = Field(default=2, ge=2, le=8)
    min_letters: int = Field(default=1, ge=1, le=1000)


def capital_share(text: str) -> tuple[float, int]:
    """``(capitals / cased letters, cased letters)`` of ``text``; ``(0.0, 0)`` when it has no cased letter."""
    upper = sum(1 for c in text if c.isupper())
    cased = upper + sum(1 for c in text if c.islower())
    return (upper / cased if cased else 0.0), cased



@dataclass(slots=True)
class ShoutState:
    """What a ``shout`` job carries between stages (``job.state``)."""

    instance: Optional[ShoutInstance] = None  # the validated instance (init)
    turns: int = 0  # model turns the episode had (run)

class ShoutHandler(AgentHandler):
    """See the module docstring. Instance: :class:`ShoutInstance`."""

    name = "shout"
    needs_llm = True
    instance_model = ShoutInstance  # a malformed instance is refused at submit (422)
    state_model = ShoutState
    #: process terms (weight 0 unless the request's reward_weights names them): the language mixing of the
    #: model's turns, and ``turn_scores``, the mean capital share of the turns that answered the feedback
    reward_terms = (LANGUAGE_MIXING, "turn_scores")

    async def init(self, job) -> None:
        job.state.instance = ShoutInstance.model_validate(job.instance)

    async def run(self, job) -> None:
        inst: ShoutInstance = job.state.instance
        if job.llm is None:
            raise RuntimeError("this server has no LLM context")
        backend = await job.backend()
        tokenizer = await job.llm.tokenizer(backend)
        max_len = (await job.llm.client.model_info(backend.address)).max_model_len
        sp = dict(job.sampling_params or {})
        per_turn = int(sp.pop("max_tokens", 0) or 16)
        conv = await Conversation.create(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                                                     {"role": "user", "content": inst.prompt}],
                                         max_context_tokens=max_len)
        finish = "max_turns"
        try:
            while conv.num_turns < inst.turns:
                if conv.room < 1:
                    finish = "length"
                    break
                comp = await job.llm.client.complete(conv.token_ids, backend=job,
                                                     max_tokens=min(per_turn, conv.room), sampling_params=sp)
                conv.add_completion(comp)
                if conv.num_turns < inst.turns and not await conv.add_messages(
                        [{"role": "user", "content": inst.feedback}]):
                    finish = "length"
                    break
        except BaseException:
            # Whoever caused it (the job's deadline cancelling a turn, a backend fault), keep the turns the model
            # completed: a failure scored against it (model_timeout) is trained on them, as the agent loop's are
            # (red team R10: a timeout in turn 2 returned no trajectory, message or turn).
            if conv.num_turns:
                self._keep(job, conv, "error")
            raise
        self._keep(job, conv, finish)

    @staticmethod
    def _keep(job, conv: Conversation, finish: str) -> None:
        """Write the conversation (its completed turns) and why it ended into ``job``."""
        conv.finish(finish)
        job.messages = conv.messages
        job.trajectories = conv.trajectories()
        job.turns = list(conv.turns)
        job.add_token_stats(TokenStats(**conv.token_stats()))
        job.state.turns = conv.num_turns
        job.extra["shout"] = {"turns": conv.num_turns, "finish_reason": finish}

    def restore_for_eval(self, job, result) -> None:
        """What :meth:`init` and :meth:`run` left for eval: the validated instance and the number of model
        turns (recorded in ``extra["shout"]["turns"]``); eval reads the rest from the messages."""
        shout = result.extra.get("shout")
        turns = shout.get("turns") if isinstance(shout, dict) else None
        if not isinstance(turns, int) or isinstance(turns, bool):
            raise NotRegradableError("the result has no extra.shout.turns (how many model turns the episode had)")
        job.state.instance = ShoutInstance.model_validate(job.instance)
        job.state.turns = turns

    async def eval(self, job) -> None:
        inst: ShoutInstance = job.state.instance
        # The reward is the last generated turn's alone, and only if the episode reached it: a rollout cut
        # short by the context has no answer to the feedback.
        texts = [m.get("content") or "" for m in job.messages if m.get("role") == "assistant"]
        # A per-character pass over each turn: off the event loop when the turns are long (the policy's doing).
        shares = await off_loop(lambda: [capital_share(t) for t in texts], chars=sum(map(len, texts)))
        reached = job.state.turns >= inst.turns
        share, cased = shares[-1] if reached and texts else (0.0, 0)
        job.resolved = reached and cased >= inst.min_letters and share == 1.0
        job.extra.setdefault("shout", {}).update(capital_share=share, cased_letters=cased)
        # Per-turn placement: the outcome is the last turn's; each turn that answered the feedback scores its
        # own capital share (host-computed from the generated text the server recorded, as the outcome is).
        aligned = len(texts) == len(turn_records(job)) and texts
        answers = [s / (len(texts) - 1) for s, _ in shares[1:]]
        per_turn = [0.0, *answers] if len(texts) > 1 else ([0.0] * len(texts))
        terms = await process_terms_async(job, (LANGUAGE_MIXING,))
        weight = float(job.reward_weights.get("turn_scores", 0.0))
        terms["turn_scores"] = RewardComponent(value=math.fsum(per_turn), weight=weight,
                                               per_turn=per_turn if aligned else None)
        compose_reward(job, share, terms,
                       outcome_per_turn=[0.0] * (len(texts) - 1) + [share] if aligned else None)


def load_dataset(arg: Optional[str] = None, limit: Optional[int] = None, seed: int = 0) -> list[dict]:
    """``limit`` (default 16) shout instances, prompts "Say something about <topic>." over
    :data:`TOPICS`, shuffled with ``seed``; ``arg`` is the number of model turns (default 2)."""
    rng = random.Random(seed)
    topics = list(TOPICS)
    rng.shuffle(topics)
    turns = int(arg) if arg else 2
    n = limit or 16
    return [{"data_source": "shout", "instance_id": f"shout-{seed}-{i}",
             "prompt": f"Say something about {topics[i % len(topics)]}.", "turns": turns} for i in range(n)]
