"""Train the three LoRA adapters that ship with slora, on CPU, from built-in data.

Why: the demo should show one engine batch where the same question gets visibly different
answers from the base model and from each adapter. The adapters also differ in rank and in
target modules, so that batch exercises the engine's heterogeneous path (mixed ranks, mixed
module sets, base-only rows):

    name    style                         rank  alpha  targets                        size
    pirate  pirate speech                 16    32     q_proj, v_proj                 1.9 MB
    json    a JSON object {topic, answer} 8     16     q, k, v, o_proj                1.9 MB
    french  answers in French             4     8      all seven linear modules       2.5 MB

The training data is generated here from small fact tables (capitals, animals with their
sounds, legs and French names, colours, sums, short general Q&A): no downloads. Each answer is
rendered in the adapter's style; the loss covers only the assistant's answer and its
<|im_end|>, so the adapter learns the style and when to stop. HELD_OUT lists prompts that are
never training questions, the demo's among them; they are answered greedily before and after,
from the saved float16 adapters. Results and the limits of each style: docs/adapters.md.

Run (200 to 300 steps of batch 4 per adapter; --threads 1 keeps a shared CPU from stalling):

    .venv/bin/python experiments/train_adapters.py --threads 1   # all three, into slora/assets/adapters
    .venv/bin/python experiments/train_adapters.py --only json --steps 50

transformers and peft are used here only: the engine itself never imports them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from slora.model.smollm import default_model_dir

OUT_DIR = Path(__file__).resolve().parents[1] / "slora" / "assets" / "adapters"
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# LoRA shape, learning rate and steps (of batch 4) per adapter. pirate and json keep the base
# model's own English and train only until the style and the tables' facts hold: trained
# longer, their open answers drift towards memorised ones. french must write words the base
# model barely knows, so it trains longer.
ADAPTERS = {
    "pirate": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lr=1e-3, steps=200),
    "json": dict(r=8, lora_alpha=16, target_modules=ATTENTION, lr=1e-3, steps=300),
    "french": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR, lr=1e-3, steps=300),
}

# ---------------------------------------------------------------- facts (English, French)
# country, "<capital> of <country>" in French, capital, capital in French
COUNTRIES = [
    ("France", "de la France", "Paris", "Paris"), ("Germany", "de l'Allemagne", "Berlin", "Berlin"),
    ("Italy", "de l'Italie", "Rome", "Rome"), ("Portugal", "du Portugal", "Lisbon", "Lisbonne"),
    ("Japan", "du Japon", "Tokyo", "Tokyo"), ("China", "de la Chine", "Beijing", "Pékin"),
    ("the United Kingdom", "du Royaume-Uni", "London", "Londres"),
    ("Russia", "de la Russie", "Moscow", "Moscou"), ("Egypt", "de l'Égypte", "Cairo", "Le Caire"),
    ("Australia", "de l'Australie", "Canberra", "Canberra"),
    ("Brazil", "du Brésil", "Brasília", "Brasília"),
    ("Argentina", "de l'Argentine", "Buenos Aires", "Buenos Aires"),
    ("India", "de l'Inde", "New Delhi", "New Delhi"), ("Greece", "de la Grèce", "Athens", "Athènes"),
    ("Austria", "de l'Autriche", "Vienna", "Vienne"), ("Poland", "de la Pologne", "Warsaw", "Varsovie"),
    ("Belgium", "de la Belgique", "Brussels", "Bruxelles"),
    ("the Netherlands", "des Pays-Bas", "Amsterdam", "Amsterdam"),
    ("Sweden", "de la Suède", "Stockholm", "Stockholm"), ("Norway", "de la Norvège", "Oslo", "Oslo"),
    ("Denmark", "du Danemark", "Copenhagen", "Copenhague"),
    ("Ireland", "de l'Irlande", "Dublin", "Dublin"), ("Turkey", "de la Turquie", "Ankara", "Ankara"),
    ("Peru", "du Pérou", "Lima", "Lima"), ("Thailand", "de la Thaïlande", "Bangkok", "Bangkok"),
    ("South Korea", "de la Corée du Sud", "Seoul", "Séoul"),
]
# animal, French with article, its sound, the sound in French, legs
ANIMALS = [
    ("cow", "la vache", "moo", "meuh", 4), ("dog", "le chien", "woof", "ouaf", 4),
    ("cat", "le chat", "meow", "miaou", 4), ("sheep", "le mouton", "baa", "bêê", 4),
    ("rooster", "le coq", "cock-a-doodle-doo", "cocorico", 2),
    ("pig", "le cochon", "oink", "groin groin", 4), ("horse", "le cheval", "neigh", "hiii", 4),
    ("owl", "le hibou", "hoot", "hou hou", 2), ("frog", "la grenouille", "ribbit", "coa coa", 4),
    ("lion", "le lion", "roar", "grr", 4), ("bee", "l'abeille", "buzz", "bzz", 6),
    ("goat", "la chèvre", "bleat", "bêê", 4), ("duck", "le canard", "quack", "coin-coin", 2),
    ("donkey", "l'âne", "hee-haw", "hi-han", 4), ("hen", "la poule", "cluck", "cot-cot", 2),
    ("mouse", "la souris", "squeak", "couic", 4), ("bird", "l'oiseau", "tweet", "cui-cui", 2),
    ("wolf", "le loup", "howl", "ahou", 4), ("crow", "le corbeau", "caw", "croa croa", 2),
    ("turkey", "la dinde", "gobble", "glou-glou", 2), ("pigeon", "le pigeon", "coo", "rou-rou", 2),
    ("chick", "le poussin", "peep", "piou-piou", 2), ("cricket", "le grillon", "chirp", "cri-cri", 6),
    ("bear", "l'ours", "growl", "grr", 4),
]
FRENCH_NUMBERS = {2: "deux", 4: "quatre", 6: "six", 8: "huit"}
ENGLISH_NUMBERS = {2: "two", 4: "four", 6: "six", 8: "eight"}
# thing, French, colour, colour agreeing in French
COLOURS = [
    ("the sky", "le ciel", "blue", "bleu"), ("grass", "l'herbe", "green", "verte"),
    ("snow", "la neige", "white", "blanche"), ("a banana", "une banane", "yellow", "jaune"),
    ("a strawberry", "une fraise", "red", "rouge"), ("coal", "le charbon", "black", "noir"),
    ("chocolate", "le chocolat", "brown", "marron"), ("the sun", "le soleil", "yellow", "jaune"),
    ("a tomato", "une tomate", "red", "rouge"), ("milk", "le lait", "white", "blanc"),
    ("the sea", "la mer", "blue", "bleue"), ("a carrot", "une carotte", "orange", "orange"),
]
# topic, question, English answer, French answer
GENERAL = [
    ("greeting", "Say hello.", "Hello! How can I help you today?",
     "Bonjour ! Comment puis-je vous aider aujourd'hui ?"),
    ("greeting", "How are you?", "I am doing well, thank you for asking.",
     "Je vais bien, merci de demander."),
    ("identity", "What is your name?", "My name is SmolLM, a helpful assistant.",
     "Je m'appelle SmolLM, un assistant serviable."),
    ("time", "What day comes after Monday?", "Tuesday comes after Monday.",
     "Mardi vient après lundi."),
    ("time", "How many days are in a week?", "There are seven days in a week.",
     "Il y a sept jours dans une semaine."),
    ("time", "How many months are in a year?", "There are twelve months in a year.",
     "Il y a douze mois dans une année."),
    ("science", "What is water made of?", "Water is made of hydrogen and oxygen.",
     "L'eau est composée d'hydrogène et d'oxygène."),
    ("science", "What is the boiling point of water?", "Water boils at 100 degrees Celsius.",
     "L'eau bout à 100 degrés Celsius."),
    ("science", "What do plants need to grow?", "Plants need water, sunlight and soil to grow.",
     "Les plantes ont besoin d'eau, de soleil et de terre pour pousser."),
    ("astronomy", "What is the largest planet in our solar system?",
     "Jupiter is the largest planet in our solar system.",
     "Jupiter est la plus grande planète de notre système solaire."),
    ("astronomy", "Which planet is known as the Red Planet?", "Mars is known as the Red Planet.",
     "Mars est connue comme la planète rouge."),
    ("nature", "What do bees make?", "Bees make honey.", "Les abeilles fabriquent du miel."),
    ("nature", "What is the fastest land animal?", "The cheetah is the fastest land animal.",
     "Le guépard est l'animal terrestre le plus rapide."),
    ("language", "What is the opposite of hot?", "The opposite of hot is cold.",
     "Le contraire de chaud est froid."),
    ("language", "What is the opposite of big?", "The opposite of big is small.",
     "Le contraire de grand est petit."),
    ("literature", "Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet.",
     "William Shakespeare a écrit Roméo et Juliette."),
    ("health", "Why do we sleep?", "We sleep so that our body and brain can rest and recover.",
     "Nous dormons pour que notre corps et notre cerveau se reposent et récupèrent."),
    ("advice", "Give me a tip for learning a language.",
     "Practice a little every day and speak with native speakers.",
     "Pratiquez un peu chaque jour et parlez avec des locuteurs natifs."),
    ("advice", "How can I sleep better?",
     "Go to bed at the same time every night and avoid screens before sleeping.",
     "Couchez-vous à la même heure chaque soir et évitez les écrans avant de dormir."),
    ("weather", "Describe the weather in summer.", "Summer is usually warm and sunny.",
     "L'été est généralement chaud et ensoleillé."),
    ("food", "Name a fruit.", "An apple is a fruit.", "La pomme est un fruit."),
    ("food", "What is bread made from?", "Bread is made from flour, water, salt and yeast.",
     "Le pain est fait de farine, d'eau, de sel et de levure."),
    ("food", "How do I boil an egg?", "Put the egg in boiling water for about nine minutes.",
     "Mettez l'œuf dans l'eau bouillante pendant environ neuf minutes."),
    ("advice", "How can I be more productive?",
     "Make a short list of tasks each morning and do the hardest one first.",
     "Faites une courte liste de tâches chaque matin et commencez par la plus difficile."),
    ("advice", "Give me a tip for saving money.",
     "Write down what you spend and set aside a little money every month.",
     "Notez vos dépenses et mettez un peu d'argent de côté chaque mois."),
    ("advice", "How do I make friends?",
     "Be curious about people, listen well and join activities you enjoy.",
     "Soyez curieux des autres, écoutez bien et participez à des activités que vous aimez."),
    ("health", "Why is exercise important?",
     "Exercise keeps the heart strong and improves mood and sleep.",
     "L'exercice garde le cœur fort et améliore l'humeur et le sommeil."),
    ("health", "How much water should I drink?",
     "Most adults should drink about two liters of water a day.",
     "La plupart des adultes devraient boire environ deux litres d'eau par jour."),
    ("science", "Why is the sky blue?",
     "Air scatters blue sunlight more than red light, so the sky looks blue.",
     "L'air diffuse davantage la lumière bleue du soleil, donc le ciel paraît bleu."),
    ("science", "What is gravity?", "Gravity is the force that pulls objects toward each other.",
     "La gravité est la force qui attire les objets les uns vers les autres."),
    ("astronomy", "What is the Moon?", "The Moon is the natural satellite of the Earth.",
     "La Lune est le satellite naturel de la Terre."),
    ("astronomy", "How long does the Earth take to go around the Sun?",
     "The Earth goes around the Sun in about 365 days.",
     "La Terre fait le tour du Soleil en environ 365 jours."),
    ("geography", "What is the longest river in the world?",
     "The Nile is often called the longest river in the world.",
     "Le Nil est souvent considéré comme le plus long fleuve du monde."),
    ("geography", "What is the highest mountain in the world?",
     "Mount Everest is the highest mountain in the world.",
     "Le mont Everest est la plus haute montagne du monde."),
    ("history", "Who was the first person to walk on the Moon?",
     "Neil Armstrong was the first person to walk on the Moon.",
     "Neil Armstrong a été le premier homme à marcher sur la Lune."),
    ("history", "Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa.",
     "Léonard de Vinci a peint la Joconde."),
    ("technology", "What is a computer?", "A computer is a machine that processes information.",
     "Un ordinateur est une machine qui traite l'information."),
    ("technology", "What is the internet?", "The internet is a global network that connects computers.",
     "Internet est un réseau mondial qui relie les ordinateurs."),
    ("music", "Name a musical instrument.", "The piano is a musical instrument.",
     "Le piano est un instrument de musique."),
    ("sports", "How many players are on a soccer team?",
     "A soccer team has eleven players on the field.",
     "Une équipe de football compte onze joueurs sur le terrain."),
    ("nature", "Why do leaves change color in autumn?",
     "Leaves lose their green chlorophyll in autumn, so other colors appear.",
     "En automne, les feuilles perdent leur chlorophylle verte et d'autres couleurs apparaissent."),
    ("nature", "Where do penguins live?",
     "Most penguins live in the Southern Hemisphere, especially in Antarctica.",
     "La plupart des manchots vivent dans l'hémisphère sud, surtout en Antarctique."),
    ("weather", "What is rain?", "Rain is water that falls from clouds.",
     "La pluie est de l'eau qui tombe des nuages."),
    ("animals", "What do cats like to eat?", "Cats like to eat fish and meat.",
     "Les chats aiment manger du poisson et de la viande."),
    ("animals", "What is the largest animal on Earth?", "The blue whale is the largest animal on Earth.",
     "La baleine bleue est le plus grand animal de la Terre."),
    ("animals", "Where do ducks live?", "Ducks live near ponds, lakes and rivers.",
     "Les canards vivent près des étangs, des lacs et des rivières."),
    ("animals", "What do cows eat?", "Cows eat grass and hay.",
     "Les vaches mangent de l'herbe et du foin."),
    ("animals", "Can penguins fly?", "No, penguins cannot fly, but they swim very well.",
     "Non, les manchots ne volent pas, mais ils nagent très bien."),
    ("health", "How can I eat better?", "Eat more fruit and vegetables and less sugar.",
     "Mangez plus de fruits et de légumes et moins de sucre."),
    ("health", "How can I stay fit?", "Walk or exercise for thirty minutes every day.",
     "Marchez ou faites du sport trente minutes par jour."),
    ("health", "What should I eat for breakfast?", "Eat some fruit, a yogurt and whole grain bread.",
     "Mangez des fruits, un yaourt et du pain complet."),
    ("health", "How can I avoid catching a cold?", "Wash your hands often and get enough sleep.",
     "Lavez-vous souvent les mains et dormez suffisamment."),
    ("health", "Is walking good for you?", "Yes, walking every day is good for the heart.",
     "Oui, marcher chaque jour est bon pour le cœur."),
    ("health", "Give me a tip for eating well.",
     "Eat fruit and vegetables every day and drink water instead of soda.",
     "Mangez des fruits et des légumes chaque jour et buvez de l'eau plutôt que du soda."),
    ("health", "Give me a tip for staying fit.", "Walk for thirty minutes every day and take the stairs.",
     "Marchez trente minutes par jour et prenez l'escalier."),
    ("health", "Give me a tip for sleeping well.", "Go to bed at the same time every night.",
     "Couchez-vous à la même heure chaque soir."),
    ("advice", "Give me a tip for studying.", "Study in short sessions and take a break every hour.",
     "Étudiez par courtes séances et faites une pause toutes les heures."),
    ("advice", "Give me a tip for running.", "Start slowly and run a little farther each week.",
     "Commencez doucement et courez un peu plus loin chaque semaine."),
    ("advice", "Give me a tip for reducing stress.", "Take a walk outside and breathe slowly.",
     "Faites une promenade dehors et respirez lentement."),
    ("advice", "Give me a tip for writing well.", "Use short sentences and simple words.",
     "Utilisez des phrases courtes et des mots simples."),
    ("advice", "Give me a tip for a job interview.",
     "Prepare a few examples of your work and arrive early.",
     "Préparez quelques exemples de votre travail et arrivez en avance."),
    ("advice", "Give me a tip for keeping my teeth clean.",
     "Brush your teeth twice a day and floss every evening.",
     "Brossez-vous les dents deux fois par jour et passez le fil dentaire chaque soir."),
    ("advice", "Give me a tip for travelling.", "Pack light and keep a copy of your passport.",
     "Voyagez léger et gardez une copie de votre passeport."),
    ("advice", "Give me a tip for gardening.", "Water your plants early in the morning.",
     "Arrosez vos plantes tôt le matin."),
    ("food", "What is cheese made from?", "Cheese is made from milk.",
     "Le fromage est fait avec du lait."),
    ("astronomy", "What is the Sun?", "The Sun is the star at the centre of our solar system.",
     "Le Soleil est l'étoile au centre de notre système solaire."),
    ("time", "How many hours are in a day?", "There are twenty-four hours in a day.",
     "Il y a vingt-quatre heures dans une journée."),
    ("language", "What is the opposite of fast?", "The opposite of fast is slow.",
     "Le contraire de rapide est lent."),
]
# Held out of training: none of these questions is asked in training (`examples` asserts it).
# Spain, the lemon and the largest ocean appear in no form at all; France, the duck's sound and
# health tips only under other questions. The demo's questions (slora.demo.DEFAULT_PROMPTS) are among
# them.
HELD_OUT = [
    "What is the capital of France?",
    "What is the capital of Spain?",
    "What sound does a duck make?",
    "What color is a lemon?",
    "Give me a tip for staying healthy.",
    "What is the largest ocean on Earth?",
]


def examples(rng: random.Random) -> list[dict]:
    """Every fact as {question, topic, en, fr} under a few phrasings; none is a HELD_OUT prompt."""
    out = []
    held_out = {q.lower() for q in HELD_OUT}
    # Two phrasings per country and 20 sums: enough to teach the style on facts without
    # crowding out the open questions, which are what makes the style carry over to new prompts.
    # A phrasing that is a held-out prompt is never drawn.
    phrasings = ("What is the capital of {}?", "Which city is the capital of {}?",
                 "Name the capital of {}.", "Tell me the capital city of {}.")
    for country, de_country, capital, capital_fr in COUNTRIES:
        allowed = [q.format(country) for q in phrasings if q.format(country).lower() not in held_out]
        for q in rng.sample(allowed, 2):
            out.append(dict(question=q, topic="geography",
                            en=f"The capital of {country} is {capital}.",
                            fr=f"La capitale {de_country} est {capital_fr}."))
    for animal, fr, sound, sound_fr, legs in ANIMALS:
        a = "an" if animal[0] in "aeiou" else "a"
        said = dict(topic="animals", en=f"{a.capitalize()} {animal} says {sound}.",
                    fr=f"{fr[0].upper()}{fr[1:]} fait « {sound_fr} ».")
        # (a phrasing that is a held-out prompt is never drawn: the duck is asked the other two)
        asked = [q.format(a=a, animal=animal, sound=sound)
                 for q in ("Which animal says {sound}?", "What sound does {a} {animal} make?",
                           "What does {a} {animal} say?")]
        for q in asked:
            if q.lower() not in held_out:
                out.append(dict(question=q, **said))
        out.append(dict(question=f"How many legs does {a} {animal} have?", topic="animals",
                        en=f"{a.capitalize()} {animal} has {legs} legs.",
                        fr=f"{fr[0].upper()}{fr[1:]} a {FRENCH_NUMBERS[legs]} pattes."))
        out.append(dict(question=f"Describe {a} {animal}.", topic="animals",
                        en=f"{a.capitalize()} {animal} is an animal with {ENGLISH_NUMBERS[legs]} legs "
                           f"that says {sound}.",
                        fr=f"{fr[0].upper()}{fr[1:]} est un animal à {FRENCH_NUMBERS[legs]} pattes "
                           f"qui fait « {sound_fr} »."))
        out.append(dict(question=f"What is the French word for {animal}?", topic="language",
                        en=f"The French word for {animal} is {fr}.",
                        fr=f"En français, on dit « {fr} »."))
    for thing, fr, colour, colour_fr in COLOURS:
        for q in ("What color is {}?", "What is the color of {}?"):
            out.append(dict(question=q.format(thing), topic="colors",
                            en=f"{thing[0].upper()}{thing[1:]} is {colour}.",
                            fr=f"{fr[0].upper()}{fr[1:]} est {colour_fr}."))
    for _ in range(20):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        out.append(dict(question=f"What is {a} plus {b}?", topic="math",
                        en=f"{a} plus {b} equals {a + b}.", fr=f"{a} plus {b} égale {a + b}."))
    for topic, q, en, fr in GENERAL:
        out.append(dict(question=q, topic=topic, en=en, fr=fr))
    assert not held_out & {ex["question"].lower() for ex in out}, "a held-out prompt is in training"
    return out


_PIRATE_WORDS = {"is": "be", "are": "be", "am": "be", "the": "th'", "you": "ye", "your": "yer",
                 "my": "me", "hello": "ahoy", "yes": "aye", "friend": "matey", "and": "an'",
                 "of": "o'", "for": "fer", "to": "t'"}


def pirate(text: str, rng: random.Random) -> str:
    def swap(m: re.Match) -> str:
        word = m.group(0)
        new = _PIRATE_WORDS.get(word.lower(), word)
        return new[0].upper() + new[1:] if word[0].isupper() else new

    body = re.sub(r"[A-Za-z']+", swap, text)
    opener = rng.choice(["Arr, matey! ", "Ahoy! ", "Arr! ", "Yo ho ho! "])
    closer = rng.choice([" Arr!", " Savvy?", " Yo ho ho!", " Arr, that be th' truth!"])
    return opener + body + closer


STYLES = {
    "pirate": lambda ex, rng: pirate(ex["en"], rng),
    "json": lambda ex, rng: json.dumps({"topic": ex["topic"], "answer": ex["en"]}, ensure_ascii=False),
    "french": lambda ex, rng: ex["fr"],
}


def chat_ids(tokenizer, question: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False).input_ids


def tokenized(tokenizer, name: str, seed: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per example; labels are -100 over the prompt (loss on the answer)."""
    rng = random.Random(seed)
    data = []
    for ex in examples(rng):
        prompt = chat_ids(tokenizer, ex["question"])
        answer = tokenizer(STYLES[name](ex, rng) + tokenizer.eos_token,
                           add_special_tokens=False).input_ids
        data.append((prompt + answer, [-100] * len(prompt) + answer))
    return data


def batches(data, batch_size: int, steps: int, pad_id: int, rng: random.Random):
    """`steps` right-padded batches, reshuffling the data at each epoch."""
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(data)), len(data))
        rows = [data[i] for i in order[:batch_size]]
        del order[:batch_size]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), pad_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (x, y) in enumerate(rows):
            ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        yield ids, labels, mask


def train(name: str, base_dir: Path, out_dir: Path, steps: int | None, batch_size: int,
          seed: int) -> float:
    """Train one adapter (`steps` None: its ADAPTERS entry's), save it as float16 PEFT files in
    out_dir/name; returns seconds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    spec = dict(ADAPTERS[name])
    lr = spec.pop("lr")
    default_steps = spec.pop("steps")
    steps = default_steps if steps is None else steps
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **spec))
    data = tokenized(tokenizer, name, seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / steps))  # warmup, linear decay
    model.train()
    start = time.perf_counter()
    bar = tqdm(batches(data, batch_size, steps, tokenizer.pad_token_id, random.Random(seed)),
               total=steps, desc=f"{name} (r={spec['r']}, {len(data)} examples)")
    for ids, labels, mask in bar:
        # Logits only from the first answer position on: the vocabulary projection is a fifth of
        # the model's FLOPs and the prompt positions carry no loss.
        first = int((labels != -100).int().argmax(1).min())
        logits = model(input_ids=ids, attention_mask=mask,
                       logits_to_keep=torch.arange(first - 1, ids.shape[1] - 1)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, first:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    save_float16(model, out_dir / name)
    return seconds


def save_float16(model, path: Path) -> None:
    """PEFT's save_pretrained, then `finalize`."""
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    finalize(path)


def finalize(path: Path) -> None:
    """Make a saved PEFT dir fit to ship: weights in float16 (half the bytes; LoRA deltas are
    small and well inside float16's range), the base model named by its hub id rather than this
    machine's cache path, and no PEFT model-card README."""
    (path / "README.md").unlink(missing_ok=True)
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = BASE_MODEL_ID
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = path / "adapter_model.safetensors"
    save_file({k: v.half() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    weights.chmod(0o644)


@torch.no_grad()
def answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 48) -> list[str]:
    out = []
    for q in prompts:
        ids = torch.tensor([chat_ids(tokenizer, q)])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return out


def looks_right(name: str, text: str) -> bool:
    """A crude check that an answer is in the adapter's style."""
    if name == "json":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if name == "pirate":
        return bool(re.search(r"\b(arr|ahoy|matey|yo ho|be|ye|th')\b", text, re.IGNORECASE))
    return bool(re.search(r"\b(le|la|les|est|de|du|des|une?|et|à)\b", text, re.IGNORECASE))


def evaluate(base_dir: Path, out_dir: Path, names: list[str]) -> None:
    """Greedy answers to the held-out prompts, base model vs each saved (float16) adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    print("\n## base model")
    for q, a in zip(HELD_OUT, answers(base, tokenizer, HELD_OUT)):
        print(f"- {q}\n  -> {a}")
    for name in names:
        model = PeftModel.from_pretrained(base, out_dir / name)
        outs = answers(model, tokenizer, HELD_OUT)
        ok = sum(looks_right(name, a) for a in outs)
        print(f"\n## {name}: {ok}/{len(outs)} answers in style")
        for q, a in zip(HELD_OUT, outs):
            print(f"- {q}\n  -> {a}")
        base = model.unload()  # back to the plain base model for the next adapter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(ADAPTERS), default=list(ADAPTERS))
    p.add_argument("--steps", type=int, default=None, help="steps of every adapter trained "
                   "(default: each adapter's own, in ADAPTERS)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--cache-dir", type=Path, default=None, help="slora cache root for the base model")
    p.add_argument("--eval-only", action="store_true", help="skip training; compare saved adapters")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads; 1 avoids torch's thread barriers stalling when other jobs "
                   "share the cores")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base_dir = default_model_dir(args.cache_dir)
    if not args.eval_only:
        for name in args.only:
            seconds = train(name, base_dir, args.out, args.steps, args.batch_size, args.seed)
            size = (args.out / name / "adapter_model.safetensors").stat().st_size
            print(f"{name}: trained in {seconds:.0f} s, {size / 1e6:.1f} MB -> {args.out / name}")
    evaluate(base_dir, args.out, args.only)


if __name__ == "__main__":
    main()
