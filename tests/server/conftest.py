"""A real uvicorn server on 127.0.0.1 (a free port) over the tiny random Qwen3 target + drafter."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import pytest

MODEL = "tiny-qwen3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_engine(tiny_dirs, **cfg):
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    cfg.setdefault("max_model_len", 256)
    return LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(**cfg))


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    engine: object
    loop: object
    uvicorn: object
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=60, **kw)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no request holds a row or waits for one."""
        deadline = time.monotonic() + timeout
        sched = self.engine.scheduler
        while time.monotonic() < deadline:
            if sched.slots.num_used == 0 and sched.num_waiting == 0 and sched.num_running == 0:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(15)
        self.loop.stop()


def start_server(engine, model: str = MODEL, **app_options) -> RunningServer:
    import uvicorn

    from dflash_trt.engine.engine_loop import EngineLoop
    from dflash_trt.server.app import create_app
    from dflash_trt.server.metrics import ServerMetrics

    metrics = ServerMetrics(engine.scheduler, engine.max_draft_len, model)
    loop = EngineLoop(engine, on_step=metrics.observe_step, on_finish=metrics.observe_finished).start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(loop, model, metrics, **app_options), host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", engine, loop, server, thread)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=8, max_queue_len=64))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(tiny_dirs):
    """A separate engine, decoding plainly, whose generate() gives the expected answers: every server test that
    compares with it checks the speculative server against the target's own decoding (its samples too, by seed)."""
    return tiny_engine(tiny_dirs, max_batch_size=8, speculative=False)


# --- a target whose own greedy answer is two tool calls -----------------------------------------------------

CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
ANSWER = "I will look." + "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in CALLS)
QUESTION = [{"role": "user", "content": "weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in CALLS]
# How Qwen3's and Qwen3.5's chat templates write an assistant's calls (their tool-call loops, cut to the calls)
QWEN3_TEMPLATE = ("{%- for m in messages %}{%- for c in m.tool_calls or [] %}"
                  "{{- '<tool_call>\\n{\"name\": \"' }}{{- c.function.name }}{{- '\", \"arguments\": ' }}"
                  "{{- c.function.arguments | tojson }}{{- '}\\n</tool_call>\\n' }}{%- endfor %}{%- endfor %}")
QWEN3_5_TEMPLATE = ("{%- for m in messages %}{%- for c in m.tool_calls or [] %}"
                    "{{- '<tool_call>\\n<function=' ~ c.function.name ~ '>\\n' -}}"
                    "{%- for k, v in c.function.arguments | items %}"
                    "{{- '<parameter=' ~ k ~ '>\\n' ~ (v | tojson if v is not string else v) ~ '\\n</parameter>\\n' -}}"
                    "{%- endfor %}{{- '</function>\\n</tool_call>\\n' -}}{%- endfor %}{%- endfor %}")


def trained_to_answer(root, messages: list[dict], answer: str, specials: tuple[str, ...] = ()) -> tuple:
    """A tiny target trained to answer messages with answer (a character tokenizer of 100 ids spells braces; specials
    are added past the characters as special tokens, as harmony's are), and a random drafter: the engine's greedy
    answer is the target's own."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from tests.conftest import make_drafter, make_target

    target = make_target(root / "target", vocab=98 + len(specials) if specials else 100)
    tok = AutoTokenizer.from_pretrained(target)
    if specials:
        tok.add_tokens([AddedToken(t, special=True) for t in specials], special_tokens=True)
        tok.save_pretrained(target)
    model = Qwen3ForCausalLM.from_pretrained(target)
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                  ["input_ids"])
    ids = torch.tensor([prompt + tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.005:
            break
    model.eval().save_pretrained(target)
    return target, make_drafter(root / "drafter", target, block_size=16)


@pytest.fixture(scope="session")
def caller(tmp_path_factory):
    """A tiny target trained to answer QUESTION with ANSWER, and a random drafter."""
    return trained_to_answer(tmp_path_factory.mktemp("caller"), QUESTION, ANSWER)
