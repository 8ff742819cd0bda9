"""Varied chat prompts for training and evaluating a chat model's Eagle head.

No dataset is downloaded: prompts are built from task templates over topics.
The split is by topic (every fifth topic is held out), so held-out prompts
ask about subjects the head never saw answers about, in the same phrasings.
"""

from __future__ import annotations

__all__ = ["TASKS", "TOPICS", "chat_prompts"]

TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "the water cycle",
    "compound interest", "the Roman Empire", "volcanoes", "machine learning", "honeybees",
    "the printing press", "climate change", "the human heart", "prime numbers", "jazz music",
    "the Moon landing", "electric cars", "coral reefs", "the stock market", "vaccines",
    "the Great Wall of China", "recycling", "earthquakes", "the internet", "chess",
    "the Renaissance", "solar panels", "sleep", "the Amazon rainforest", "democracy",
    "bread baking", "the Olympic Games", "DNA", "rainbows", "the Silk Road", "penguins",
    "gravity", "coffee", "the periodic table", "ancient Egypt", "public libraries",
    "glaciers", "bicycles", "the immune system", "Shakespeare", "tea ceremonies",
    "renewable energy", "the solar system", "bees and pollination", "origami",
    "the Industrial Revolution", "tides", "meditation", "dinosaurs", "credit cards",
    "the piano", "deserts", "time zones", "the Eiffel Tower", "composting", "lightning",
    "octopuses", "the Byzantine Empire", "hurricanes", "supply and demand", "mushrooms",
    "the telescope", "urban gardening", "the Great Barrier Reef", "fermentation", "elephants",
    "the Apollo program", "blood types", "the Mongol Empire", "wind turbines", "tornadoes",
    "the metric system", "sourdough", "the Sahara", "vitamin D", "the steam engine",
    "photography", "migratory birds", "the Pythagorean theorem", "ancient Greek theatre",
    "inflation", "the ozone layer", "submarines", "the Hubble telescope", "yoga",
    "the Panama Canal", "antibiotics", "cryptography", "the Arctic", "typewriters",
    "marathon running", "the Mayan civilization", "plate tectonics", "maple syrup", "radio waves",
    "the Louvre", "nuclear fusion", "the Wright brothers", "knitting", "the blue whale",
    "volunteering", "the Nile", "robotics", "the Magna Carta", "cave paintings",
    "hot air balloons", "the Cold War", "chocolate", "memory and forgetting", "lighthouses",
)

TASKS = (
    "Explain {} in simple terms.",
    "Give me three interesting facts about {}.",
    "Write a short paragraph about {} for a ten-year-old.",
    "What are the main advantages and disadvantages of {}?",
    "Summarize the history of {} in a few sentences.",
    "Write a haiku about {}.",
    "List five questions a student might ask about {}.",
    "How would you describe {} to someone who has never heard of it?",
    "Why is {} important?",
    "Write a short story that involves {}.",
    "What is a common misconception about {}?",
    "Give a step-by-step explanation of how {} works.",
)


def chat_prompts(split: str) -> list[str]:
    """Every task over the topics of a split: "train" (4 topics in 5) or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    held = split == "heldout"
    return [task.format(topic) for i, topic in enumerate(TOPICS) if (i % 5 == 4) == held
            for task in TASKS]
