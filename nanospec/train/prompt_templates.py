"""The material the training prompts are made from: templates, slots to fill them, tasks (data only; see
:mod:`nanospec.train.prompts`)."""

PER_CATEGORY = 160
SEED = 1234

TOWNS = ["Harwick", "Port Ellis", "Greenvale", "Marston", "Oakridge", "Lindenfeld", "Bayford", "Cold Spring",
         "Ashby", "Riverton", "Kilmore", "Westbrook", "Thornbury", "Millhaven", "Elmstead", "Dunmore"]
PEOPLE = ["Maria Lopez", "James Okafor", "Chen Wei", "Aisha Rahman", "Tom Becker", "Sofia Rossi", "Lars Nilsson",
          "Priya Nair", "Daniel Cohen", "Hana Sato", "Oliver Grant", "Fatima Diallo", "Ivan Petrov", "Emma Walsh",
          "Lucas Martin", "Nora Jensen", "Samuel Adeyemi", "Yuki Tanaka", "Clara Meyer", "Ravi Kumar"]
COMPANIES = ["Brightleaf Foods", "Northwind Tools", "Bluepeak Software", "Cedar & Co", "Solara Energy",
             "Quickship Logistics", "Greenhill Farms", "Atlas Bikes", "Silverline Travel", "Pinecone Games"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

PASSAGES = [
    "The {town} swimming pool will close for repairs on {day} {month}. The work will replace the old heating "
    "system and retile the main pool. Season tickets will be extended by the number of days the pool is shut, "
    "and lessons will move to the school gym in {town2} during the closure.",
    "{company} reported that sales rose by {pct} percent last year, mostly thanks to new customers abroad. The "
    "company plans to open a second warehouse in {town} and to hire about {n} people. Its chief executive, "
    "{person}, said prices will stay the same for at least another year.",
    "A new bus line will connect {town} and {town2} from {month}. Buses will run every {mins} minutes on weekdays "
    "and every hour at weekends. A single ticket will cost {price} euros, and children under six travel free.",
    "{person} has lived in {town} for {n} years and runs a small repair shop for bicycles. Every summer she "
    "organises a free workshop where children learn how to fix a flat tyre, adjust brakes and oil a chain. This "
    "year more than {n2} children signed up.",
    "The annual {town} book fair takes place on the first weekend of {month}. More than {n} publishers will show "
    "their new titles, and there will be readings by local authors every afternoon. Entry is free on Sunday, "
    "but on Saturday a ticket costs {price} euros.",
    "Heavy rain caused the river near {town} to rise by almost two metres overnight. Several roads were closed "
    "and the school on Mill Lane stayed shut on {weekday}. The council has opened a hotline for residents who "
    "need sandbags or help moving furniture.",
    "{company} is recalling {n} electric kettles sold between {month} and {month2} because the lid can come "
    "loose when the water boils. Customers should stop using the kettle and return it to any shop for a full "
    "refund. No injuries have been reported so far.",
    "Scientists at the University of {town} have found that bees visit flowers less often on windy days. The "
    "team, led by {person}, watched {n} hives over two summers. They say the result could help farmers decide "
    "where to plant hedges that shelter their fields.",
    "The {town} football club won its last match of the season {score} against {town2}. The winning goal came "
    "in the final minute from a young player who joined the team only in {month}. The club finishes third in "
    "the league, its best result in ten years.",
    "From next {month}, residents of {town} must sort their rubbish into four bins: paper, glass, plastic and "
    "food waste. Collection will happen every {weekday}. Anyone who needs extra bins can order them online or "
    "collect them from the town hall.",
    "The hotel on the main square of {town} has {n} rooms, a small garden and a restaurant that serves "
    "breakfast from seven to ten. Guests can borrow bicycles for free. Check-in starts at three in the "
    "afternoon, and pets are allowed for a fee of {price} euros per night.",
    "{person} started learning the violin at the age of {age}. After years of practice she now plays in the "
    "{town} city orchestra and teaches beginners on {weekday} evenings. She says the hardest part was learning "
    "to be patient with herself.",
]

SUMMARY_TASKS = [
    "Summarize this in one sentence.", "Summarize this text in two sentences.",
    "Give the three most important facts from this text as bullet points.",
    "Rewrite this paragraph in simpler words for a child.", "Shorten this text to about half its length.",
    "Write a headline for this news text.", "Rewrite this as a short, formal announcement.",
    "Summarize this for a busy reader, keeping all numbers and dates.",
    "Rewrite this text in the first person, as if you were the organiser.",
    "What is the main point of this text? Answer in one sentence.",
]
LIST_TASKS = [
    ("Sort this list alphabetically and keep each line as written.", None),
    ("Rewrite this list as one sentence.", None),
    ("Turn this list into a numbered list.", None),
    ("Group these items into two categories and list them.", None),
]
LIST_ITEMS = ["pencils", "a stapler", "printer paper", "blue folders", "sticky notes", "a ruler", "scissors",
              "rice", "carrots", "olive oil", "onions", "pasta", "garlic", "yoghurt", "oranges", "a tent",
              "a torch", "hiking boots", "a sleeping bag", "sun cream", "a water bottle", "a rain jacket"]

FUNCTIONS = [
    ("python", "def total_price(items):\n    total = 0\n    for item in items:\n"
               "        total = total + item['price'] * item['qty']\n    return total"),
    ("python", "def count_words(text):\n    counts = {}\n    for word in text.split():\n        if word in counts:\n"
               "            counts[word] += 1\n        else:\n            counts[word] = 1\n    return counts"),
    ("python", "def average(values):\n    s = 0\n    for v in values:\n        s += v\n    return s / len(values)"),
    ("python", "def find_max(numbers):\n    best = numbers[0]\n    for n in numbers:\n        if n > best:\n"
               "            best = n\n    return best"),
    ("python", "def read_names(path):\n    f = open(path)\n    names = f.read().splitlines()\n    f.close()\n"
               "    return names"),
    ("python", "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        return False"),
    ("python", "def greet(name):\n    print('Hello, ' + name + '!')"),
    ("python", "def filter_adults(people):\n    result = []\n    for p in people:\n        if p['age'] >= 18:\n"
               "            result.append(p)\n    return result"),
    ("python", "class Counter:\n    def __init__(self):\n        self.value = 0\n\n    def add(self):\n"
               "        self.value += 1"),
    ("python", "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32"),
    ("python", "def reverse_words(sentence):\n    words = sentence.split(' ')\n    words.reverse()\n"
               "    return ' '.join(words)"),
    ("python", "def get_user(users, user_id):\n    for u in users:\n        if u['id'] == user_id:\n"
               "            return u"),
    ("javascript", "function sumArray(arr) {\n  var total = 0;\n  for (var i = 0; i < arr.length; i++) {\n"
                   "    total += arr[i];\n  }\n  return total;\n}"),
    ("javascript", "function capitalize(word) {\n  return word[0].toUpperCase() + word.slice(1);\n}"),
    ("javascript", "function getEmails(users) {\n  var emails = [];\n  for (var i = 0; i < users.length; i++) {\n"
                   "    emails.push(users[i].email);\n  }\n  return emails;\n}"),
]
EDITS = [
    "Add type hints to this function and return the whole code.",
    "Add a docstring that explains what this code does. Return the whole code.",
    "Make this code handle an empty input without crashing. Return the whole code.",
    "Rewrite this code to be shorter, using built-in functions where you can.",
    "Rename the function to something more descriptive and return the code.",
    "Add comments to every line of this code.",
    "Fix any bug you can find in this code and explain the fix in one sentence.",
    "Rewrite this code using a list comprehension or a similar one-line expression where possible.",
    "Convert this code to modern style (for example const/let in JavaScript, f-strings in Python).",
    "Add a short example of how to call this code.",
]

CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the largest of three numbers",
    "counts the vowels in a string", "converts a temperature from Fahrenheit to Celsius",
    "removes duplicates from a list while keeping the order", "returns the factorial of a number",
    "checks whether a number is prime", "merges two sorted lists into one sorted list",
    "returns the second largest number in a list", "reverses a string",
    "computes the sum of the digits of an integer", "flattens a list of lists",
    "counts how many times each character appears in a string", "returns the greatest common divisor of two numbers",
    "checks whether two strings are anagrams", "returns the n first square numbers",
    "converts a list of words to a single comma-separated string", "finds the longest word in a sentence",
    "reads a CSV file and returns the number of rows", "returns the median of a list of numbers",
    "checks whether a year is a leap year", "splits a list into chunks of a given size",
    "returns the words of a sentence sorted by length", "computes the average of the values in a dictionary",
    "converts a number of seconds into hours, minutes and seconds", "checks that a password has at least eight "
    "characters and one digit", "returns a dictionary that maps each word to its length",
    "finds all even numbers in a list", "capitalizes the first letter of every word",
    "computes compound interest", "returns the index of an item in a sorted list using binary search",
    "generates a random password of a given length",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Python", "Go", "Python", "Rust", "Python", "C"]
CODE_FORMS = [
    "Write a {lang} function that {task}.", "Write a {lang} function that {task}. Add a short docstring or comment.",
    "In {lang}, write a function that {task}, and show one example call.",
    "Write a simple {lang} program that {task}.", "Implement a function in {lang} that {task}.",
]
OTHER_CODE = [
    "Write a SQL query that returns the ten customers with the highest total order value from tables customers "
    "and orders.", "Write a SQL query that counts the orders per month in a table named orders with a column "
    "created_at.", "Write a bash command that counts the lines of every .txt file in the current folder.",
    "Write a Python class Rectangle with width and height and a method that returns its area.",
    "Write a Python class BankAccount with deposit and withdraw methods that refuse to go below zero.",
    "Write a Python script that prints the numbers from 1 to 20, but prints Fizz for multiples of three.",
    "Write an HTML page with a title and a form that asks for a name and an email address.",
    "Write a Python function that sends a GET request to a URL with the requests library and returns the JSON.",
]

QA_CONTEXTS = [
    ("The {town} museum of science opens at {hour} in the morning from Tuesday to Sunday and is closed on "
     "Mondays. Adults pay {price} euros, students pay half, and children under twelve enter free. Guided tours in "
     "English start at eleven and at three.",
     ["How much does a student pay?", "When are the guided tours?", "On which day is the museum closed?",
      "Who can enter for free, and what does an adult pay?"]),
    ("{person} was born in {town} in {year}. She studied chemistry in {town2} and later worked for {company} "
     "for {n} years. In {year2} she founded her own laboratory, which now employs {n2} people.",
     ["Where did she study?", "When did she found her laboratory?", "How many people work in her laboratory?",
      "Which company did she work for, and for how long?"]),
    ("The {company} office is on the fourth floor of the glass building next to {town} station. Visitors must "
     "sign in at the front desk and wear a badge. Parking is available in the garage behind the building for "
     "{price} euros per day, and the office is open from eight to six.",
     ["On which floor is the office?", "How much does parking cost?", "What must visitors do when they arrive?",
      "Where is the building and when is it open?"]),
    ("Lake {name} is about {n} kilometres long and lies between {town} and {town2}. Its deepest point is {depth} "
     "metres. Swimming is allowed from June to September, and a ferry crosses the lake four times a day.",
     ["How deep is the lake?", "When is swimming allowed?", "How often does the ferry cross?",
      "Which towns does the lake lie between, and how long is it?"]),
    ("The {town} marathon starts at {hour} o'clock on {day} {month}. Runners must collect their numbers the day "
     "before at the sports hall. There are water stations every five kilometres, and the route closes six hours "
     "after the start.",
     ["When does the marathon start?", "Where do runners collect their numbers?", "How often are there water "
      "stations?", "When does the route close?"]),
    ("{company} sells three plans: Basic costs {price} euros a month and includes 10 GB of storage, Plus costs "
     "twice as much and includes 100 GB, and Pro costs {price2} euros and includes unlimited storage and phone "
     "support. All plans can be cancelled at any time.",
     ["What does the Plus plan cost?", "Which plan includes phone support?", "How much storage does Basic have?",
      "Can a plan be cancelled, and which plan is the cheapest?"]),
    ("The community garden in {town} has {n} plots. Each plot costs {price} euros a year, and members must "
     "water their plants at least twice a week in summer. Tools are kept in the green shed, and the key is with "
     "{person}.",
     ["How many plots are there?", "Who has the key to the shed?", "How often must members water?",
      "What does a plot cost and where are the tools?"]),
]
QA_FORMS = ["Answer from the context only.\n\nContext: {ctx}\n\nQuestion: {q}",
            "Context: {ctx}\n\nQuestion: {q}", "Use only this text to answer.\n\n{ctx}\n\n{q}",
            "Read the text and answer the question in one sentence.\n\nText: {ctx}\n\nQuestion: {q}"]

CHAT = [
    "Explain how {thing} works in simple terms.", "Explain {thing} to a ten-year-old.",
    "Give me three tips for {activity}.", "What are the advantages of {habit}?",
    "What should I know before {activity}?", "Write a short poem about {nature}.",
    "Suggest a name for a {shop} and explain why.", "How can I get better at {skill}?",
    "Write a friendly message inviting a friend to {event}.", "What is the difference between {pair}?",
    "Describe a typical day of a {job}.", "Write a short story about a {animal} who {story}.",
    "Why is {nature} important for the planet?", "Give me a simple plan for {activity}.",
    "What is {topic}?", "Tell me about {topic} in a few sentences.", "Why is {topic} interesting?",
    "Explain {topic} to someone who has never heard of it.", "Give three facts about {topic}.",
    "What are the pros and cons of {habit}?", "Write a short thank-you note to a {job}.",
]
FILL = {
    "thing": ["a refrigerator", "the internet", "a bicycle gear", "a solar panel", "a vaccine", "an elevator",
              "a compass", "photosynthesis", "a credit card", "a microwave oven", "GPS", "a heat pump"],
    "activity": ["starting to run", "learning a new language", "moving to a new city", "planting a vegetable "
                 "garden", "saving money each month", "travelling by train across Europe", "adopting a cat",
                 "preparing for a job interview", "cooking for a large group", "studying for an exam"],
    "habit": ["walking every day", "reading before bed", "cooking at home", "keeping a diary",
              "going to bed early", "cycling to work", "learning to play an instrument"],
    "nature": ["the ocean", "forests", "autumn leaves", "a thunderstorm", "the moon", "bees", "mountains",
               "a quiet river", "the first snow"],
    "shop": ["flower shop", "bicycle repair shop", "small bookshop", "tea room", "pet grooming salon",
             "second-hand clothing store", "ice cream stand"],
    "skill": ["public speaking", "drawing", "chess", "writing emails", "remembering names", "typing"],
    "event": ["a picnic on Saturday", "a board game evening", "a birthday dinner", "a walk in the hills",
              "a concert next week"],
    "pair": ["weather and climate", "a virus and a bacterium", "a lake and a sea", "speed and velocity",
             "a noun and a verb", "saving and investing", "a comet and an asteroid"],
    "topic": ["volcanoes", "the Roman Empire", "black holes", "the water cycle", "electric cars", "chocolate",
              "the human heart", "earthquakes", "the printing press", "coral reefs", "the Olympic Games",
              "recycling", "the moon landing", "tea", "glaciers", "the immune system", "wind turbines", "jazz",
              "the pyramids of Egypt", "honey bees", "the Great Wall of China", "sleep", "clouds", "whales",
              "chess", "the metric system", "deserts", "bread", "the Amazon rainforest", "yoga", "dinosaurs",
              "the stock market", "magnets", "origami", "the seasons", "vitamins", "lighthouses", "penguins"],
    "job": ["nurse", "firefighter", "librarian", "baker", "pilot", "farmer", "software developer"],
    "animal": ["fox", "turtle", "owl", "small dog", "rabbit", "penguin", "goat"],
    "story": ["wants to learn to swim", "finds a lost key", "makes a new friend", "gets lost in the city",
              "wins a race", "is afraid of the dark"],
}

MATH = [
    "A shop sells pens at {a} euros each. How much do {b} pens cost? Show your working.",
    "A car uses {a} litres of fuel per 100 kilometres. How much fuel does it need for {c} kilometres?",
    "What is {p}% of {d}? Explain briefly.",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {e} people?",
    "Tom has {d} marbles and gives away {a} to each of his {b} friends. How many does he have left?",
    "A cyclist rides {c} kilometres in {h} hours. What is her average speed?",
    "A jacket costs {d} euros and is reduced by {p}%. What is the new price? Show your working.",
    "A room is {a} metres long and {b} metres wide. What is its area, and how much does carpet cost at {e} "
    "euros per square metre?",
    "If {b} workers build a wall in {e} days, how long would {w} workers take at the same speed?",
    "What is {d} divided by {a}, rounded to two decimal places?",
    "A tank holds {c} litres and is filled at {a} litres per minute. How long does it take to fill?",
    "The sum of two numbers is {d} and their difference is {a}. What are the numbers?",
    "A class has {d} pupils and {p}% of them walk to school. How many pupils walk?",
    "Anna saves {a} euros every week. How many weeks does she need to save {c} euros?",
    "A train leaves at {t1} and arrives {m} minutes later. At what time does it arrive?",
    "What is {a} times {e} plus {d}? Show the steps.",
]

SENTENCES = [
    "Where is the nearest pharmacy?", "My brother works in a hospital.", "The weather will be sunny tomorrow.",
    "Could you close the window, please?", "We are going to the beach on Sunday.", "I have lost my umbrella.",
    "The shop closes at eight in the evening.", "How much does this ticket cost?", "She reads a book every week.",
    "Our train is twenty minutes late.", "I would like to book a table for two people.",
    "The children are playing in the garden.", "Please send me the report by Friday.",
    "This soup is too hot to eat.", "My phone battery is almost empty.", "Thank you very much for your help.",
    "The meeting has been moved to Thursday.", "Do you know a good restaurant near here?",
    "He forgot his keys at the office.", "It is raining, so take a jacket.",
    "The library opens at ten on Saturdays.", "I need two tickets for the evening show.",
    "We planted tomatoes in the garden last spring.", "My sister is learning to play the piano.",
    "The hotel room has a view of the sea.", "Can you help me carry these boxes?",
    "The bus stop is next to the bakery.", "I usually drink tea in the afternoon.",
    "Our neighbours have a very friendly dog.", "The bridge was closed because of the storm.",
    "Please turn off the lights when you leave.", "He has been a teacher for twenty years.",
    "The concert starts in half an hour.", "I left my glasses on the kitchen table.",
    "They are painting the house blue.", "The doctor will see you in five minutes.",
]
TARGET_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
TRANSLATE_FORMS = ["Translate into {lang}: {s}", "Translate this sentence to {lang}: {s}",
                   "How do you say this in {lang}? \"{s}\"", "Translate into {lang} and give only the translation: {s}"]

EXTRACT = [
    ("From this text, give the name and the age as JSON with keys name and age: {person} is {age} years old and "
     "lives in {town}.", {}),
    ("Extract the product and the price as JSON with keys product and price: The new {product} from {company} "
     "costs {price} euros.", {}),
    ("List the cities mentioned in this sentence as a JSON array: Last year {person} travelled from {town} to "
     "{town2} and then on to {town3}.", {}),
    ("Give the date and the time of the meeting as JSON: The board meeting is on {day} {month} at {hour} o'clock "
     "in room {n}.", {}),
    ("Extract every person's name from this text as a JSON array: {person} met {person2} and {person3} at the "
     "station in {town}.", {}),
    ("Return a JSON object with keys company, city and employees: {company} is based in {town} and employs {n} "
     "people.", {}),
    ("From this order, give a JSON list of objects with item and quantity: I would like {a} {item1}, {b} "
     "{item2} and one {item3}.", {}),
    ("Extract the email address and the phone number as JSON: Please contact {person} at info@{domain}.com or "
     "call 0{phone}.", {}),
    ("List the animals mentioned as a JSON array: In the park we saw a {animal}, two {animal2}s and a very "
     "old {animal3}.", {}),
    ("Give the title, the author and the year as JSON: The novel {title} was written by {person} and "
     "published in {year}.", {}),
]
PRODUCTS = ["coffee grinder", "desk lamp", "travel backpack", "electric toothbrush", "garden hose", "phone case"]
ITEMS = ["sandwiches", "apple juices", "croissants", "salads", "bottles of water", "muffins", "soups"]
TITLES = ["The Silent Harbour", "A Year of Small Things", "North of the River", "The Glass Orchard",
          "Letters from Marston", "The Last Lighthouse"]


STDLIB_MODULES = ["argparse", "bisect", "calendar", "colorsys", "csv", "datetime", "difflib", "fractions", "ftplib",
                  "gettext", "heapq", "imaplib", "inspect", "ipaddress", "json/__init__", "locale", "mailbox",
                  "mimetypes", "netrc", "os", "pathlib", "pprint", "quopri", "random", "shlex", "shutil", "smtplib",
                  "statistics", "string", "tarfile", "textwrap", "threading", "tokenize", "traceback", "uuid",
                  "wave", "zipfile", "configparser", "glob", "fnmatch", "functools", "gzip", "hashlib", "html/__init__",
                  "http/cookies", "logging/__init__", "numbers", "operator", "platform", "sched", "secrets",
                  "selectors", "socket", "subprocess", "tempfile", "timeit", "urllib/parse", "webbrowser"]


STD_SUMMARY = ["Summarize this documentation in one sentence.", "Explain this text in simple words.",
               "Rewrite this paragraph so a beginner can follow it.", "Give the two key points of this text.",
               "Shorten this description to one short sentence."]
STD_QA = ["What does this text say {name} does?", "According to the text, what is {name} for?",
          "What does the text say about the arguments or inputs?", "What is returned or produced, according to "
          "the text?"]
STD_CODE = ["Explain what this function does.", "Explain this code line by line.",
            "What would you name this function, and why?", "Write a test for this function."]
STD_EXTRACT = ["List every Python name (functions, variables, arguments) used in this code as a JSON array.",
               "Give the function's name and its arguments as JSON with keys name and arguments."]
