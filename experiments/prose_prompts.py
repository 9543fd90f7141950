"""Write `prose-mix-600` (runs/prose-mix-600.json): 600 requests for prose, from templates over word lists with a
seeded random choice: writing, role play, explanations of science, technology, history and culture, small logic
puzzles, translations, and summaries, extractions and questions over passages of Python's language reference
(`pydoc_data.topics`, PSF-2.0). Prompt-only Alpaca records, for a drafter head's self-distillation
(`distill.more_data`); nothing comes from a benchmark, and no prompt equals one of work-mix-48's or Spec-Bench's.

    python -m experiments.prose_prompts [--out runs/prose-mix-600.json] [--check]
    polybasic run qwen2.5-coder-1.5b-w4a8 --set "distill.more_data=[code-math-640, $PWD/runs/prose-mix-600.json]"

Not shipped and not in the recipe: on Spec-Bench the head that also learned these answers ran 1-3% faster than the
recipe's (docs/drafters.md), for 26 more minutes of the recipe. Caveat: a few of its word lists' topics are also
topics of work-mix-48 prompts (the weather and climate, why the sky is blue, a lighthouse keeper's message in a
bottle, a reusable water bottle, the French Revolution), so a profile on work-mix-48 flatters a head trained on it.
Deterministic for one Python minor version (the passages are its reference's).
"""
from __future__ import annotations

import random
import re
from pathlib import Path

from experiments.code_math_prompts import NAMES, as_records, documented, interleave, kept_apart, write_or_check

OUT = Path("runs") / "prose-mix-600.json"
SEED = 0
COUNTS = {"writing": 130, "roleplay": 60, "explain": 150, "puzzle": 40, "translate": 60, "passage": 160}
PASSAGE_CHARS = 900  # a passage's prompt stays near 250 tokens: with a 128-token answer, within training's max_len

FORMS = ["a short story", "a poem", "a blog post", "a persuasive essay", "a product description", "a speech",
         "a diary entry", "a news article", "a letter to a friend", "a travel guide entry", "a review",
         "a limerick", "a motivational message", "a fairy tale", "a dialogue between two characters",
         "an opening paragraph for a novel", "a newsletter introduction", "a toast for a wedding",
         "a social media post", "a thank-you note"]
SUBJECTS = ["a lighthouse keeper who finds a message in a bottle", "learning to ride a bicycle as an adult",
            "a city garden on a rooftop", "the first snow of winter", "a robot that wants to paint",
            "moving to a new country", "a library that never closes", "a lost dog finding its way home",
            "the night before an important exam", "a small bakery competing with a supermarket",
            "a train journey across mountains", "an old map found in an attic", "a village without electricity",
            "the importance of sleep", "a community cleaning up a river", "a chess game between strangers",
            "a reusable water bottle", "a summer job at a fruit farm", "a grandmother's recipe book",
            "a storm at sea", "the last day of school", "an astronaut's first hour in orbit",
            "a friendship between a cat and a crow", "a forgotten musical instrument", "volunteering at a shelter",
            "a noise-cancelling headset for students", "a festival of lanterns", "a mountain hut in autumn",
            "a bicycle repair workshop", "a museum of everyday objects", "a solar-powered boat",
            "a market at dawn", "a town that bans cars on Sundays", "the smell of rain",
            "a scientist who doubts her own result", "a lost umbrella's many owners", "a desert night sky",
            "an apprentice clockmaker", "the joy of cooking for friends", "a secret staircase"]
ROLES = ["a tour guide in Rome", "a ship's captain in the 1800s", "a detective in a quiet town",
         "a nutritionist", "a medieval blacksmith", "a customer support agent for a phone company",
         "a museum curator", "a park ranger", "a personal trainer", "a chef in a busy restaurant",
         "a librarian", "a job interviewer at a software company", "a travel agent", "a pirate",
         "a science teacher", "a career counselor", "a wizard's apprentice", "a news anchor",
         "a real estate agent", "a gardener"]
SITUATIONS = ["Greet a visitor and answer their first question about your work.",
              "Someone asks you for advice on a problem they have had all week. Respond in character.",
              "Describe an ordinary day in your life, in the first person.",
              "A newcomer wants to learn your job. Give them their first lesson.",
              "Tell a story from your past that taught you something.",
              "Someone is unhappy with your service. Calm them down and offer a solution."]
STEM = ["photosynthesis", "plate tectonics", "the water cycle", "how vaccines train the immune system",
        "black holes", "the greenhouse effect", "natural selection", "how a refrigerator works",
        "the difference between weather and climate", "how batteries store energy", "DNA replication",
        "how airplanes stay in the air", "the speed of light", "nuclear fusion in stars", "ocean tides",
        "how the internet routes data", "public-key encryption", "machine learning", "how GPS finds a position",
        "antibiotic resistance", "the states of matter", "how the heart pumps blood", "earthquakes",
        "how a compiler works", "the periodic table", "renewable energy sources", "how rainbows form",
        "the human microbiome", "inflation in economics", "supply and demand", "how bridges carry loads",
        "the Doppler effect", "entropy", "how memory works in the brain", "volcanoes",
        "how solar panels make electricity", "the carbon cycle", "how noise-cancelling headphones work",
        "why the sky is blue", "how databases index data"]
HUMANITIES = ["the printing press", "the Silk Road", "the Renaissance", "the Industrial Revolution",
              "the fall of the Western Roman Empire", "the invention of writing", "the French Revolution",
              "the history of the Olympic Games", "the Meiji Restoration", "the abolition of slavery",
              "the spread of coffee around the world", "the age of exploration", "ancient Egyptian religion",
              "the Harlem Renaissance", "impressionist painting", "the history of jazz", "stoic philosophy",
              "the origins of democracy in Athens", "the Cold War", "the history of the bicycle",
              "the Mongol Empire", "the Enlightenment", "the construction of the Great Wall",
              "the role of libraries in history", "the history of vaccination", "Shakespeare's influence on English",
              "utilitarian ethics", "the history of money", "the Apollo program", "the invention of photography"]
EXPLAIN = ["Explain {t} in simple terms.", "Explain {t} to a ten-year-old.", "What are the key ideas behind {t}?",
           "Write a short lesson on {t} for high school students.", "Describe {t} in three paragraphs.",
           "What are common misconceptions about {t}?", "Why does {t} matter today?",
           "Summarize what is known about {t} in a few sentences."]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese", "Dutch"]
SENTENCES = ["The museum opens at nine and closes early on Sundays.", "Please send me the report before Friday.",
             "We missed the last bus, so we walked home under the stars.", "My sister is learning to play the violin.",
             "The weather will be sunny in the morning and rainy in the afternoon.",
             "Could you recommend a good restaurant near the station?", "This recipe needs two eggs and a cup of milk.",
             "The meeting has been moved to next Tuesday.", "He reads a chapter of a book every night.",
             "Our team finished the project a week ahead of schedule.", "The children built a sandcastle on the beach.",
             "I would like to book a room for two nights.", "Water boils at one hundred degrees Celsius at sea level.",
             "The train was delayed because of the snow.", "She planted tomatoes and basil in the garden.",
             "Thank you for your help with the move last weekend."]
TRANSLATE = ["Translate into {lang}: \"{s}\"", "How would you say this in {lang}? \"{s}\"",
             "Translate the following sentence into {lang} and explain one word choice: \"{s}\""]
PASSAGE = ["Summarize the following text in three sentences.\n\n{p}",
           "Read the text below and list the main points as bullet points.\n\n{p}",
           "Extract every Python keyword or built-in name mentioned in this text, as a JSON list.\n\n{p}",
           "Using only the text below, explain what it says about {topic}.\n\n{p}",
           "Write a one-paragraph summary of this passage for a beginner.\n\n{p}",
           "Based on the passage below, write three quiz questions with their answers.\n\n{p}",
           "Rewrite the following documentation in plain, friendly English.\n\n{p}",
           "What is the single most important rule stated in this text? Quote it and explain it.\n\n{p}"]


def _puzzle(rng: random.Random) -> str:
    who = rng.sample(NAMES, 4)
    pick = rng.randint(0, 3)
    if pick == 0:
        return (f"{who[0]} is taller than {who[1]}, {who[2]} is shorter than {who[1]}, and {who[3]} is taller than "
                f"{who[0]}. Who is the shortest? Explain your reasoning.")
    if pick == 1:
        a, b = rng.sample(["cats", "birds", "painters", "runners", "students", "doctors", "gardeners"], 2)
        return f"All {a} in the club are {b}, and some {b} are left-handed. Can we conclude that some {a} are " \
               "left-handed? Explain."
    if pick == 2:
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
        d = rng.randint(2, 40)
        return f"If today is {rng.choice(days)}, what day of the week will it be in {d} days? Show how you work it out."
    return (f"{who[0]}, {who[1]} and {who[2]} each own one pet: a dog, a cat or a fish. {who[0]} does not own the dog, "
            f"and {who[1]} owns the fish. Who owns which pet?")


def _passages() -> list[tuple[str, str]]:
    """(topic, passage) from the language reference's topics: each topic's first PASSAGE_CHARS characters, cut at
    a paragraph end, its title underline removed."""
    import pydoc_data.topics

    out = []
    for topic, text in sorted(pydoc_data.topics.topics.items()):
        text = re.sub(r"\n[*=\-]{3,}\n", "\n", text.strip())
        cut = text.rfind("\n\n", 0, PASSAGE_CHARS)
        body = text[:cut if cut > 200 else PASSAGE_CHARS].strip()
        if len(body) >= 200:
            out.append((topic.replace("-", " "), body))
    return out


def records() -> list[dict]:
    avoid = kept_apart()
    rng = random.Random(SEED)

    def draw(n: int, make) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            p = make()
            if p not in avoid and p not in out:
                out.append(p)
        return out

    sentences = SENTENCES + [doc for _, _, _, doc in documented()[::7]]
    passages = _passages()
    kinds = {
        "writing": lambda: f"Write {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}.",
        "roleplay": lambda: f"You are {rng.choice(ROLES)}. {rng.choice(SITUATIONS)}",
        "explain": lambda: rng.choice(EXPLAIN).format(t=rng.choice(STEM + HUMANITIES)),
        "puzzle": lambda: _puzzle(rng),
        "translate": lambda: rng.choice(TRANSLATE).format(lang=rng.choice(LANGUAGES), s=rng.choice(sentences)),
        "passage": lambda: (lambda tp: rng.choice(PASSAGE).format(topic=tp[0], p=tp[1]))(rng.choice(passages)),
    }
    groups = {k: draw(COUNTS[k], make) for k, make in kinds.items()}
    per_round = {"writing": 13, "roleplay": 6, "explain": 15, "puzzle": 4, "translate": 6, "passage": 16}
    return as_records(interleave([(groups[k], per_round[k]) for k in kinds]))


def main(argv: list[str] | None = None) -> None:
    write_or_check(OUT, records(), argv, __doc__)


if __name__ == "__main__":
    main()
