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
    # Added for the second head (trained on a GPU): more subjects, same split rule.
    "the Roman aqueducts", "quantum computing", "sea turtles", "the Great Depression",
    "wildfires", "origami cranes", "the human brain", "sailing", "the Vikings",
    "cheese making", "solar eclipses", "the theory of evolution", "kites", "rice farming",
    "the printing of money", "sharks", "the Titanic", "volleyball", "cloud formation",
    "the Hanseatic League", "batteries", "wolves", "the Taj Mahal", "weather forecasting",
    "ancient Rome's roads", "microplastics", "the violin", "caffeine", "the Ottoman Empire",
    "snowflakes", "3D printing", "frogs", "the Declaration of Independence", "bridges",
    "the Andes mountains", "password security", "butterflies", "the Han dynasty", "gardening",
    "the speed of light", "airplanes", "ants", "the Aztec Empire", "tsunamis", "podcasts",
    "the human skeleton", "olive oil", "the Berlin Wall", "hydroelectric dams", "owls",
    "the Baroque period", "smartphones", "the Dead Sea", "spiders", "the Spanish flu",
    "GPS navigation", "bamboo", "the Louisiana Purchase", "skyscrapers", "jellyfish",
    "impressionist painting", "the water footprint of food", "trains", "the Sphinx",
    "artificial sweeteners", "the Milky Way", "camels", "the Black Death", "carbon dating",
    "table tennis", "the Incas", "magnets", "honey", "the Gold Rush", "desalination",
    "dolphins", "the Enlightenment", "video games", "the Dust Bowl", "vaccination campaigns",
    "the Colosseum", "the nitrogen cycle", "cats", "the Ming dynasty", "fireworks",
    "the human eye", "rivers", "the Crusades", "open source software", "salt",
    "mountaineering", "the Suez Canal", "bats", "the stock exchange crash of 1929",
    "noise pollution", "the guitar", "the Greek alphabet", "potatoes", "asteroids",
    "the League of Nations", "electric guitars", "the carbon cycle", "horses",
    "the Persian Empire", "sunscreen", "the Atlantic Ocean", "swimming", "the abacus",
    "sleep apnea", "the Brooklyn Bridge", "fungi in forests", "the Fibonacci sequence",
    "the Harlem Renaissance", "wind", "the Kuiper belt", "dog training", "the Reformation",
    "irrigation", "the Statue of Liberty", "antibodies", "the Samurai", "paper making",
    "the Higgs boson", "cacti", "the Phoenicians", "traffic lights", "the lymphatic system",
    "ballet", "the Sahel", "pencils", "the Hundred Years' War", "aurora borealis",
    "electricity grids", "parrots", "the Qin dynasty", "spreadsheets", "icebergs",
    "the Dutch Golden Age", "recycling plastics", "the human liver", "the tuba", "seeds",
    "the Trojan War", "smart homes", "the Mariana Trench", "beavers", "the Meiji Restoration",
    "insulin", "the Grand Canyon", "soccer", "the Cherokee Nation", "microwaves",
    "the circulatory system", "tulips", "the Hindenburg", "algorithms", "the Himalayas",
    "whales' songs", "the Great Fire of London", "lenses", "the Zulu Kingdom",
    "online privacy", "tomatoes", "the Voyager probes", "glassblowing", "the Celts",
    "protein", "the Mississippi River", "board games", "the Khmer Empire", "compasses",
    "bird nests", "the Scientific Revolution", "email", "the Andromeda galaxy", "sushi",
    "the Ice Age", "wheelchairs", "the Babylonians", "thunderstorms", "public transport",
    "the pancreas", "Mozart", "the Alps", "geckos", "the first computers", "quilting",
    "the Roman Senate", "water filters", "Mars rovers", "the Atacama Desert",
    "the scientific method", "clocks", "the Galapagos Islands", "yogurt", "libraries of Alexandria",
    "electric trains", "the kidneys", "the Silk Road's merchants", "rock climbing",
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
    "Explain {} to a beginner using an analogy.",
    "What are some fun activities related to {}?",
    "Write a short poem about {}.",
    "Compare {} with something similar and explain the differences.",
    "What should everyone know about {}?",
    "Describe the future of {} in a few sentences.",
    "Write a friendly email to a friend about {}.",
    "What are the key terms someone should learn about {}?",
    "Tell me a surprising story about {}.",
    "How has {} changed over time?",
    "Give me a short quiz with answers about {}.",
    "Explain the science behind {}.",
)


def chat_prompts(split: str) -> list[str]:
    """Every task over the topics of a split: "train" (4 topics in 5) or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    held = split == "heldout"
    return [task.format(topic) for i, topic in enumerate(TOPICS) if (i % 5 == 4) == held
            for task in TASKS]
