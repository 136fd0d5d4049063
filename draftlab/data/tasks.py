"""Generated multi-step problems with step-by-step reasoning and checkable answers.

They are the corpus of the embedded target model (split "train") and the prompts the pipeline
and the model's evaluation use (split "heldout"). The split of a problem is decided by a hash of
its normalised prompt text, so the two splits are disjoint by construction, whatever the seed.

Each family is a pair (sample, solve): sample(rng) writes a prompt, solve(prompt) parses it back
and works it out, or returns None for another family's prompt. Solving from the text alone is what
lets check_answer() grade a bare prompt string.

This module also holds the chat format (template and special tokens) of the embedded target.

Length: over 400 lines because each task family (sampler and solver, ~30 lines each) is kept
beside the others; they share the number formatting and the checkable-answer convention.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------- chat format
# Special tokens sit at ids 0..6 of every tokenizer built in this project, so ids agree across them.
PAD, EOS = "<|pad|>", "<|end|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
THINK, END_THINK = "<think>", "</think>"
# Role markers and EOS are special (dropped by decode(skip_special_tokens=True)); the think
# markers are ordinary added tokens, kept in decoded text as real reasoning models do.
SPECIAL_TOKENS = [PAD, EOS, USER, ASSISTANT, SYSTEM]
THINK_TOKENS = [THINK, END_THINK]

# Turn: role marker, newline, content, EOS. An assistant message may carry its reasoning in
# `reasoning_content` (rendered as <think>\n...\n</think>\n before the content) or inline in
# `content`; both render to the same text. The generation prompt ends with the assistant
# header, so the model's continuation starts with <think>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\n' -}}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] is defined -%}"
    "{{- '<think>\n' + message['reasoning_content'] + '\n</think>\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)

HELDOUT_PERCENT = 10  # share of all possible prompts that belong to the held-out split


@dataclass(frozen=True)
class Problem:
    family: str
    prompt: str
    reasoning: str
    answer: str

    @property
    def final(self) -> str:
        """The text after </think>: what a user reads."""
        return f"The answer is {self.answer}."

    @property
    def response(self) -> str:
        """The whole assistant turn the target is trained to generate (EOS not included)."""
        return f"{THINK}\n{self.reasoning}\n{END_THINK}\n{self.final}"

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.response}]


# ---------------------------------------------------------------------------- families
WORDS = (
    "apple banana cherry garden planet rocket silver window yellow monkey orange purple river "
    "summer winter pencil button castle dragon forest guitar hammer island jacket kitten ladder "
    "market number office parrot quarter rabbit saddle tomato umbrella valley wallet zebra "
    "bottle candle doctor engine finger hollow letter mirror needle pepper strawberry coffee "
    "balloon giraffe mississippi banana cookie puzzle tunnel lemon melon sugar paper spoon "
    "water teacher basket bridge cotton dinner kettle little middle rubber tennis butter"
).split()
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _word(rng: random.Random) -> str:
    """A real word half the time, else a pronounceable made-up one (2-4 syllables)."""
    if rng.random() < 0.5:
        return rng.choice(WORDS)
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _digits(n: int, width: int) -> list[int]:
    """Digits of n from the right (units first), zero-padded to width."""
    return [(n // 10**i) % 10 for i in range(width)]


# --- add: multi-digit addition, column by column with carries
def sample_add(rng):
    a, b = rng.randint(10, 9999), rng.randint(1, 999 if rng.random() < 0.5 else 9999)
    return rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)


def solve_add(prompt):
    m = re.fullmatch(r"(?:What is|Compute) (\d+) \+ (\d+)[?.]|Add (\d+) and (\d+)\.", prompt)
    if not m:
        return None
    a, b = (int(g) for g in m.groups() if g is not None)
    width = len(str(max(a, b)))
    lines, carry = ["Add the digits from the right."], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        s = x + y + carry
        lines.append(f"{x} + {y} + {carry} = {s}, write {s % 10}, carry {s // 10}.")
        carry = s // 10
    if carry:
        lines.append(f"Write the last carry {carry}.")
    lines.append(f"So {a} + {b} = {a + b}.")
    return "\n".join(lines), str(a + b)


# --- sub: multi-digit subtraction with borrows (never negative)
def sample_sub(rng):
    a = rng.randint(10, 9999)
    b = rng.randint(1, a - 1)
    return rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}."]).format(a=a, b=b)


def solve_sub(prompt):
    m = re.fullmatch(r"(?:What is|Compute) (\d+) - (\d+)[?.]", prompt)
    if m:
        a, b = int(m[1]), int(m[2])
    elif m := re.fullmatch(r"Subtract (\d+) from (\d+)\.", prompt):
        b, a = int(m[1]), int(m[2])
    else:
        return None
    if b > a:
        return None
    width = len(str(a))
    lines, borrow = ["Subtract the digits from the right."], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        nxt = int(x - y - borrow < 0)
        lines.append(f"{x + 10 * nxt} - {y} - {borrow} = {x + 10 * nxt - y - borrow}, borrow {nxt}.")
        borrow = nxt
    lines.append(f"So {a} - {b} = {a - b}.")
    return "\n".join(lines), str(a - b)


# --- mul: two-digit times one-digit, by splitting into tens and units
def sample_mul(rng):
    a, b = rng.randint(11, 99), rng.randint(2, 9)
    if rng.random() < 0.3:
        a, b = b, a
    return rng.choice(["What is {a} * {b}?", "Multiply {a} by {b}.", "What is {a} times {b}?"]).format(a=a, b=b)


def solve_mul(prompt):
    m = re.fullmatch(r"What is (\d+) (?:\*|times) (\d+)\?|Multiply (\d+) by (\d+)\.", prompt)
    if not m:
        return None
    a, b = (int(g) for g in m.groups() if g is not None)
    big, small = max(a, b), min(a, b)
    tens, units = big // 10 * 10, big % 10
    lines = [
        f"Split {big} into {tens} + {units}.",
        f"{tens} * {small} = {tens * small}.",
        f"{units} * {small} = {units * small}.",
        f"{tens * small} + {units * small} = {a * b}.",
    ]
    return "\n".join(lines), str(a * b)


# --- sort: a short list, by taking out the smallest (or largest) number each time
def sample_sort(rng):
    nums = rng.sample(range(100), rng.randint(3, 6))
    order = rng.choice(["from smallest to largest", "from largest to smallest"])
    return f"Sort these numbers {order}: {', '.join(map(str, nums))}."


def solve_sort(prompt):
    m = re.fullmatch(r"Sort these numbers from (smallest to largest|largest to smallest): ([\d, ]+)\.", prompt)
    if not m:
        return None
    left = [int(x) for x in m[2].split(", ")]
    pick, word = (min, "smallest") if m[1].startswith("smallest") else (max, "largest")
    lines, out = [f"Take the {word} number each time."], []
    while left:
        x = pick(left)
        left.remove(x)
        out.append(x)
        lines.append(f"{x}, left: {', '.join(map(str, left))}." if left else f"{x}, none left.")
    return "\n".join(lines), ", ".join(map(str, out))


# --- count: how often a letter appears in a word, with a running count per letter
def sample_count(rng):
    word = _word(rng)
    letter = rng.choice(word) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    return rng.choice(["How many times does the letter '{c}' appear in '{w}'?",
                       "Count the letter '{c}' in '{w}'."]).format(c=letter, w=word)


def solve_count(prompt):
    m = re.fullmatch(r"How many times does the letter '([a-z])' appear in '([a-z]+)'\?"
                     r"|Count the letter '([a-z])' in '([a-z]+)'\.", prompt)
    if not m:
        return None
    c, w = (g for g in m.groups() if g is not None)
    n, steps = 0, []
    for ch in w:
        n += ch == c
        steps.append(f"{ch} {n}")
    lines = [f"Go through '{w}' letter by letter, counting '{c}'.", ", ".join(steps) + ".",
             f"So '{c}' appears {n} time{'' if n == 1 else 's'}."]
    return "\n".join(lines), str(n)


# --- reverse: spell a word, then spell it backwards
def sample_reverse(rng):
    return rng.choice(["Reverse the word '{w}'.", "Write '{w}' backwards."]).format(w=_word(rng))


def solve_reverse(prompt):
    m = re.fullmatch(r"Reverse the word '([a-z]+)'\.|Write '([a-z]+)' backwards\.", prompt)
    if not m:
        return None
    w = m[1] or m[2]
    lines = [f"Letters: {'-'.join(w)}.", f"Backwards: {'-'.join(reversed(w))}."]
    return "\n".join(lines), w[::-1]


# --- convert: a mixed quantity into the smaller unit
UNITS = [  # (big unit, small unit, small units per big unit, name of the small unit)
    ("km", "m", 1000, "meters"), ("m", "cm", 100, "centimeters"), ("kg", "g", 1000, "grams"),
    ("h", "min", 60, "minutes"), ("min", "s", 60, "seconds"), ("day", "h", 24, "hours"),
]


def sample_convert(rng):
    big, small, k, name = rng.choice(UNITS)
    x, y = rng.randint(1, 9), rng.randint(1, k - 1)
    return rng.choice(["Convert {x} {big} {y} {small} to {name}.",
                       "How many {name} are in {x} {big} {y} {small}?"]).format(
        x=x, y=y, big=big, small=small, name=name)


def solve_convert(prompt):
    m = re.fullmatch(r"Convert (\d+) (\w+) (\d+) (\w+) to (\w+)\."
                     r"|How many (\w+) are in (\d+) (\w+) (\d+) (\w+)\?", prompt)
    if not m:
        return None
    x, big, y, small, name = m.groups()[:5] if m[1] else (m[7], m[8], m[9], m[10], m[6])
    unit = next((u for u in UNITS if u[:2] == (big, small) and u[3] == name), None)
    if unit is None:
        return None
    x, y, k = int(x), int(y), unit[2]
    lines = [f"1 {big} = {k} {small}.", f"{x} {big} = {x} * {k} {small} = {x * k} {small}.",
             f"{x * k} {small} + {y} {small} = {x * k + y} {small}."]
    return "\n".join(lines), f"{x * k + y} {small}"


# --- expr: evaluate a small arithmetic expression one operation at a time
def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def _reduce_once(toks: list) -> tuple[list, str]:
    """Do the next operation by precedence: parentheses, then *, then + and - left to right."""
    if "(" in toks:
        i = toks.index("(")  # generated expressions hold at most one (x op y) group
        x, op, y = toks[i + 1:i + 4]
        return toks[:i] + [_apply(x, op, y)] + toks[i + 5:], f"({x} {op} {y}) = {_apply(x, op, y)}"
    i = toks.index("*") - 1 if "*" in toks else 0
    x, op, y = toks[i:i + 3]
    return toks[:i] + [_apply(x, op, y)] + toks[i + 3:], f"{x} {op} {y} = {_apply(x, op, y)}"


def _expr_text(toks: list) -> str:
    return " ".join(map(str, toks)).replace("( ", "(").replace(" )", ")")


def _expr_steps(toks: list):
    """(reduction steps, value), or None when a step would go negative."""
    steps = []
    while len(toks) > 1:
        toks, step = _reduce_once(toks)
        if min(t for t in toks if isinstance(t, int)) < 0:
            return None
        steps.append(f"{step}, giving {_expr_text(toks)}." if len(toks) > 1 else f"{step}.")
    return steps, toks[0]


def sample_expr(rng):
    while True:
        n = rng.randint(3, 4)
        toks = [rng.randint(1, 9)]
        for _ in range(n - 1):
            toks += [rng.choice("+-*"), rng.randint(1, 9)]
        if rng.random() < 0.5:
            i = 2 * rng.randrange(n - 1)
            toks = toks[:i] + ["(", *toks[i:i + 3], ")"] + toks[i + 3:]
        if _expr_steps(list(toks)) is not None:
            return rng.choice(["Evaluate {e}.", "What is the value of {e}?"]).format(e=_expr_text(toks))


def solve_expr(prompt):
    m = re.fullmatch(r"Evaluate ([\d+\-*() ]+)\.|What is the value of ([\d+\-*() ]+)\?", prompt)
    if not m:
        return None
    toks = [int(t) if t.isdigit() else t for t in re.findall(r"\d+|\S", m[1] or m[2])]
    if toks.count("(") > 1 or len(toks) < 3 or (out := _expr_steps(toks)) is None:
        return None
    return "\n".join(out[0]), str(out[1])


# --- program: trace a tiny program (straight-line code or a counted loop)
VARS = "abnxy"


def sample_program(rng):
    while True:
        if rng.random() < 0.5:
            v = rng.choice(VARS)
            op = rng.choice("+-*") if rng.random() < 0.3 else rng.choice("+-")
            k = rng.randint(1, 3) if op == "*" else rng.randint(1, 9)
            lines = [f"{v} = {rng.randint(0, 9)}", f"for i in range({rng.randint(2, 4)}):",
                     f"    {v} = {v} {op} {k}", f"print({v})"]
        else:
            names = rng.sample(VARS, 2)
            lines = [f"{names[0]} = {rng.randint(1, 9)}"]
            defined = names[:1]
            for _ in range(rng.randint(1, 2)):
                tgt = rng.choice(names)
                a, b = rng.choice(defined), rng.choice(defined + [str(rng.randint(1, 9))])
                lines.append(f"{tgt} = {a} {rng.choice('+-*')} {b}")
                defined = sorted(set(defined + [tgt]), key=names.index)
            lines.append(f"print({rng.choice(defined)} {rng.choice('+-')} {rng.choice(defined)})")
        prompt = "What does this program print?\n" + "\n".join(lines)
        if solve_program(prompt) is not None:
            return prompt


def _value(tok: str, env: dict) -> int:
    return int(tok) if tok.isdigit() else env[tok]


def _eval_line(expr: str, env: dict) -> tuple[int, str]:
    """Value of 'p' or 'p op q', and its working ('x + 3 = 4 + 3 = 7')."""
    parts = expr.split()
    if len(parts) == 1:
        return _value(parts[0], env), f"{expr} = {_value(parts[0], env)}" if not parts[0].isdigit() else expr
    p, op, q = parts
    x, y = _value(p, env), _value(q, env)
    return _apply(x, op, y), f"{expr} = {x} {op} {y} = {_apply(x, op, y)}"


def solve_program(prompt):
    m = re.fullmatch(r"What does this program print\?\n(.+)", prompt, flags=re.S)
    if not m:
        return None
    src, env, lines = m[1].split("\n"), {}, []
    try:
        i = 0
        while i < len(src):
            if loop := re.fullmatch(r"for i in range\((\d)\):", src[i]):
                body = src[i + 1].strip()
                v, expr = body.split(" = ")
                for it in range(int(loop[1])):
                    env[v], work = _eval_line(expr, env)
                    lines.append(f"i = {it}: {v} = {work}.")
                i += 2
            elif out := re.fullmatch(r"print\((.+)\)", src[i]):
                val, work = _eval_line(out[1], env)
                lines.append(f"print {work}." if " " in out[1] else f"print {out[1]} = {val}.")
                i += 1
            else:
                v, expr = src[i].split(" = ")
                env[v], work = _eval_line(expr, env)
                lines.append(f"{v} = {work}.")
                i += 1
    except (KeyError, ValueError):
        return None
    # keep the numbers small enough for the model: no negative and no three-digit values
    if not re.fullmatch(r"print\(.+\)", src[-1]) or any(v < 0 or v > 99 for v in list(env.values()) + [val]):
        return None
    return "\n".join(lines), str(val)


FAMILY_FUNCS = {
    "add": (sample_add, solve_add), "sub": (sample_sub, solve_sub), "mul": (sample_mul, solve_mul),
    "sort": (sample_sort, solve_sort), "count": (sample_count, solve_count),
    "reverse": (sample_reverse, solve_reverse), "convert": (sample_convert, solve_convert),
    "expr": (sample_expr, solve_expr), "program": (sample_program, solve_program),
}
FAMILIES = tuple(FAMILY_FUNCS)


# ---------------------------------------------------------------------------- public API
def split_of(prompt: str) -> str:
    """'heldout' or 'train', from a hash of the prompt with case and spacing normalised."""
    norm = " ".join(prompt.lower().split())
    h = int.from_bytes(hashlib.sha256(norm.encode()).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def solve(prompt: str) -> Problem | None:
    """The problem a prompt states, worked out; None if no family recognises it."""
    for family, (_, solve_fn) in FAMILY_FUNCS.items():
        if (out := solve_fn(prompt)) is not None:
            return Problem(family, prompt, *out)
    return None


def generate(n: int, seed: int, split: str, families=FAMILIES, ran_out: list | None = None) -> list[Problem]:
    """n problems of `split`, families in turn; same (n, seed, split) -> same list.

    Held-out problems are all distinct (they are evaluation prompts); train problems may repeat.
    A family whose distinct held-out prompts run out leaves the rotation and the others go on
    (the first problems do not change with n; `ran_out`, when given, gets the name of each such
    family); when every family has run out, ValueError says how many there were.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{seed}:{split}")
    out, seen = [], set()
    active, turn = list(families), 0
    while len(out) < n:
        if not active:
            raise ValueError(f"every task family ran out of distinct {split} prompts: there are {len(out)} (asked for {n})")
        family = active[turn % len(active)]
        sample_fn, solve_fn = FAMILY_FUNCS[family]
        for _ in range(10_000):
            prompt = sample_fn(rng)
            if split_of(prompt) == split and not (split == "heldout" and prompt in seen):
                break
        else:  # this family has no new prompt left: the others take its turns
            active.remove(family)
            if ran_out is not None:
                ran_out.append(family)
            continue
        seen.add(prompt)
        out.append(Problem(family, prompt, *solve_fn(prompt)))
        turn += 1
    return out


def extract_answer(text: str) -> str | None:
    """The final answer in an assistant turn: 'The answer is X.' after </think>, else None."""
    if END_THINK not in text:
        return None
    tail = text.rsplit(END_THINK, 1)[1].replace(EOS, "").strip()
    m = re.fullmatch(r"The answer is (.+?)\.?", tail, flags=re.S)
    return " ".join(m[1].split()) if m else None


def check_answer(problem_or_prompt: Problem | str, text: str) -> bool:
    """True when the assistant turn `text` ends with the problem's correct answer."""
    problem = problem_or_prompt
    if isinstance(problem, str):
        problem = solve(problem)
        if problem is None:
            raise ValueError(f"not a prompt of any task family: {problem_or_prompt[:80]!r}")
    return extract_answer(text) == problem.answer
