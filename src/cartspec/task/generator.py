"""Seeded generator of shopper requests with gold answers.

Every attribute is rendered by one of several *phrasing families* (``"sz 10"``,
``"size 10"``, ``"in a 10"``...). Each value pool and each family list is split
in two: the ``seen`` part is all that ``train`` ever uses; ``dev`` and ``test``
draw mostly from the ``held`` part, so their accuracy measures generalisation to
unseen words and values, not recall of training strings.

Each request carries ``meta.families``: the phrasing families it used, so tests
(and error analysis) can check coverage family by family.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from .data import Request, Turn
from .policies import support_reply
from .schema import SearchParams, SupportTopic, canonical_dict, canonical_json

Split = Literal["train", "dev", "test"]
SPLIT_SEEDS = {"train": 1, "dev": 2, "test": 3}


@dataclass(frozen=True)
class Pool:
    """Values of one kind, split into what training sees and what it never sees."""

    seen: tuple
    held: tuple

    def pick(self, rng: random.Random, split: Split, p_held: float = 0.6):
        if split != "train" and self.held and rng.random() < p_held:
            return rng.choice(self.held)
        return rng.choice(self.seen)


# --- catalogue ---------------------------------------------------------------
# product -> category; held-out products still name their kind plainly.
PRODUCTS: dict[str, Pool] = {
    "shoes": Pool(("running shoes", "trail running shoes", "sneakers", "hiking boots", "sandals",
                   "loafers", "ankle boots", "basketball shoes", "slippers", "high heels", "clogs",
                   "chelsea boots", "espadrilles", "snow boots", "cleats", "ballet flats"),
                  ("rain boots", "tennis shoes", "flip flops", "walking shoes")),
    "clothing": Pool(("t-shirt", "hoodie", "jeans", "rain jacket", "dress", "sweater", "leggings",
                      "winter coat", "polo shirt", "shorts", "pajamas", "swimsuit", "blazer", "skirt",
                      "flannel shirt", "joggers", "tank top", "parka", "overalls", "socks"),
                     ("cardigan", "puffer vest", "chinos", "denim jacket")),
    "electronics": Pool(("wireless headphones", "earbuds", "laptop", "smartwatch", "bluetooth speaker",
                         "phone case", "gaming mouse", "monitor", "tablet", "usb-c charger", "soundbar",
                         "hdmi cable", "fitness tracker", "portable ssd", "router"),
                        ("mechanical keyboard", "webcam", "power bank", "e-reader")),
    "home": Pool(("coffee maker", "desk lamp", "bed sheets", "throw pillow", "cookware set",
                  "air fryer", "vacuum cleaner", "duvet cover", "kettle", "toaster", "rug", "curtains",
                  "frying pan", "candle"),
                 ("blender", "bath towels", "table lamp", "dinnerware set")),
    "beauty": Pool(("moisturizer", "lipstick", "shampoo", "perfume", "sunscreen", "mascara", "body lotion",
                    "eyeliner", "hair dryer", "face wash"),
                   ("face serum", "conditioner", "nail polish")),
    "sports": Pool(("yoga mat", "dumbbells", "tennis racket", "bike helmet", "water bottle",
                    "soccer ball", "resistance bands", "running belt",
                    "foam roller", "ski goggles", "basketball"),
                   ("jump rope", "camping tent", "golf balls")),
    "toys": Pool(("lego set", "board game", "jigsaw puzzle", "plush toy", "toy car", "action figure",
                  "teddy bear", "train set", "rc car", "card game"),
                 ("doll house", "kite", "building blocks")),
    "bags": Pool(("backpack", "tote bag", "duffel bag", "wallet", "suitcase", "messenger bag",
                  "handbag", "carry-on", "gym bag"),
                 ("crossbody bag", "laptop sleeve", "fanny pack")),
    "jewelry": Pool(("necklace", "earrings", "bracelet", "ring", "watch", "brooch", "chain",
                     "hoop earrings"),
                    ("anklet", "pendant", "cufflinks")),
    "grocery": Pool(("coffee beans", "green tea", "protein powder", "olive oil", "dark chocolate",
                     "oat milk", "peanut butter", "espresso pods", "maple syrup"),
                    ("granola", "honey", "pasta sauce")),
}

BRANDS: dict[str, Pool] = {
    "shoes": Pool(("nike", "adidas", "new balance", "asics", "puma", "hoka", "brooks", "vans",
                   "converse", "skechers", "reebok", "salomon", "timberland",
                   "dr. martens", "crocs", "clarks", "mizuno"), ("saucony", "merrell", "birkenstock", "on running")),
    "clothing": Pool(("levi's", "uniqlo", "zara", "h&m", "patagonia", "the north face", "gap",
                      "columbia", "ralph lauren", "tommy hilfiger", "calvin klein",
                      "mango", "champion", "wrangler"), ("carhartt", "arc'teryx", "lululemon", "everlane")),
    "electronics": Pool(("sony", "bose", "apple", "samsung", "logitech", "jbl", "dell", "lenovo",
                         "anker", "lg", "microsoft", "hp",
                         "beats", "xiaomi", "canon"), ("sennheiser", "razer", "asus", "garmin")),
    "home": Pool(("ikea", "keurig", "philips", "cuisinart", "dyson", "ninja", "kitchenaid", "smeg",
                  "tefal", "bosch", "oxo"),
                 ("breville", "le creuset", "shark")),
    "beauty": Pool(("loreal", "nivea", "maybelline", "cerave", "neutrogena", "garnier", "revlon",
                    "olay", "dior"),
                   ("the ordinary", "clinique", "dove")),
    "sports": Pool(("wilson", "under armour", "decathlon", "yeti", "manduka", "babolat", "mikasa",
                    "oakley", "gaiam"),
                   ("hydro flask", "spalding", "head")),
    "toys": Pool(("lego", "hasbro", "mattel", "melissa & doug", "hot wheels",
                   "vtech", "crayola"), ("ravensburger", "fisher-price", "playmobil")),
    "bags": Pool(("samsonite", "herschel", "fjallraven", "michael kors", "coach", "eastpak",
                  "jansport", "longchamp"),
                 ("osprey", "tumi", "kipling")),
    "jewelry": Pool(("pandora", "swarovski", "tiffany", "fossil", "cartier",
                     "citizen", "timex"), ("casio", "seiko", "mejuri")),
    "grocery": Pool(("lavazza", "twinings", "optimum nutrition", "lindt", "nespresso",
                     "starbucks", "myprotein"),
                    ("illy", "ghirardelli", "barilla")),
}

# Misspellings shoppers really type; gold keeps the true name.
BRAND_TYPOS = {"adidas": "addidas", "skechers": "sketchers", "new balance": "new ballance",
               "nike": "nikee", "samsung": "samsng", "levi's": "levis", "loreal": "l'oreal",
               "saucony": "sauconi", "sennheiser": "senheiser", "patagonia": "patagucci"}

COLORS = Pool(("black", "white", "red", "blue", "green", "navy", "grey", "pink", "beige", "brown",
               "yellow", "purple", "orange", "tan", "khaki", "charcoal", "ivory",
               "lavender", "coral", "mint", "turquoise", "mustard"), ("olive", "burgundy", "teal", "maroon", "cream", "silver"))
COLOR_ABBREV = {"black": "blk", "white": "wht", "grey": "gray", "navy": "nvy", "brown": "brn",
                "green": "grn", "blue": "blu", "burgundy": "wine", "maroon": "mrn", "olive": "olv"}

MATERIALS: dict[str, Pool] = {
    "shoes": Pool(("leather", "suede", "canvas", "mesh", "knit", "rubber"), ("cork", "merino")),
    "clothing": Pool(("cotton", "wool", "polyester", "denim", "linen", "silk", "fleece", "nylon",
                          "corduroy", "bamboo"), ("cashmere", "merino")),
    "home": Pool(("cotton", "linen", "stainless steel", "bamboo", "ceramic", "wood",
                  "velvet", "wool"), ("cast iron", "glass")),
    "bags": Pool(("leather", "canvas", "nylon", "polyester", "suede", "denim"), ("vegan leather", "cork")),
    "jewelry": Pool(("silver", "gold", "stainless steel", "rose gold"), ("titanium", "platinum")),
    "sports": Pool(("rubber", "foam", "stainless steel", "carbon fiber", "nylon"), ("cork", "aluminum")),
}
COLORED = {"shoes", "clothing", "electronics", "home", "sports", "bags", "jewelry", "toys"}
AUDIENCES_FOR = {
    "shoes": ("men", "women", "kids", "boys", "girls", "unisex"),
    "clothing": ("men", "women", "kids", "boys", "girls", "baby", "unisex"),
    "toys": ("kids", "boys", "girls", "baby"),
    "jewelry": ("men", "women"),
    "beauty": ("men", "women"),
    "sports": ("men", "women", "kids", "unisex"),
    "bags": ("men", "women", "kids", "unisex"),
    "electronics": ("kids",),
}

AUDIENCE_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # audience: (seen forms, held forms); "{}" marks where the product goes
    "men": (("men's {}", "mens {}", "{} for men", "{} for guys", "male {}", "{} for a man"), ("{} for him", "{} for my husband")),
    "women": (("women's {}", "womens {}", "{} for women", "female {}", "{} for my wife",
                "{} for a woman"), ("ladies {}", "{} for her")),
    "kids": (("kids {}", "{} for kids", "kid's {}", "{} for little ones", "youth {}"), ("children's {}",)),
    "boys": (("boys {}", "{} for boys", "boy's {}", "{} for a boy"), ("{} for my son",)),
    "girls": (("girls {}", "{} for girls", "girl's {}", "{} for a girl"), ("{} for my daughter",)),
    "baby": (("baby {}", "{} for a baby", "{} for babies", "newborn {}"), ("infant {}", "{} for a toddler")),
    "unisex": (("unisex {}", "{} for men and women", "{} for anyone"), ("gender-neutral {}",)),
}

SIZES = {
    "shoes": Pool(("7", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12", "40", "42", "44", "7.5", "39", "43"),
                  ("6.5", "11.5", "13", "38", "45")),
    "clothing": Pool(("xs", "s", "m", "l", "xl", "xxl", "32x30", "34x32", "2xl", "32x32", "30x32"), ("3xl", "30x30", "36x34")),
}
SIZE_WORDS = {"s": "small", "m": "medium", "l": "large", "xs": "extra small", "xl": "extra large"}

CURRENCIES = {
    # code: (seen renderings, held renderings); {} is the amount
    "USD": (("${}", "{} dollars", "{} usd", "{} bucks", "usd {}", "$ {}", "{} dollar"), ("{}$", "US${}")),
    "EUR": (("€{}", "{} euros", "{} eur", "eur {}", "€ {}", "{} euro"), ("{}€", "EUR {}")),
    "GBP": (("£{}", "{} pounds", "{} gbp", "gbp {}", "£ {}", "{} pound", "{} british pounds"), ("{} quid", "GBP {}")),
    "CAD": (("C${}", "{} cad", "cad {}", "CA${}", "{} canadian"), ("{} canadian dollars",)),
    "JPY": (("¥{}", "{} yen", "{}¥", "jpy {}", "{} japanese yen"), ("{} jpy",)),
}
CURRENCY_WEIGHTS = {"USD": 0.55, "EUR": 0.18, "GBP": 0.15, "CAD": 0.07, "JPY": 0.05}


def _fam(seen: tuple[str, ...], held: tuple[str, ...]) -> Pool:
    return Pool(seen, held)


# Phrasing families per attribute: name -> template (seen/held split by name).
PRICE_MAX = _fam(("under {p}", "below {p}", "less than {p}", "max {p}", "up to {p}", "at most {p}",
                  "maximum {p}", "{p} max", "not over {p}", "no higher than {p}", "within {p}",
                  "budget {p}", "{p} tops", "lower than {p}", "for less than {p}"),
                 ("no more than {p}", "{p} or less", "cheaper than {p}", "<{p}"))
PRICE_MIN = _fam(("over {p}", "above {p}", "more than {p}", "at least {p}", "min {p}", "minimum {p}",
                  "{p} and up", "{p}+", "upwards of {p}", "{p} minimum", "not under {p}",
                  "higher than {p}", "from {p} up", "pricier than {p}"),
                 ("{p} or more", "starting at {p}", ">{p}"))
PRICE_RANGE = _fam(("between {a} and {b}", "{a}-{b}", "from {a} to {b}", "{a} - {b}", "price {a}-{b}",
                    "somewhere between {a} and {b}", "{a} up to {b}"),
                   ("{a} to {b}", "in the {a}-{b} range"))
RATING = _fam(("{r}+ stars", "at least {r} stars", "rated {r} and up", "{r} stars or more",
               "{r} stars and up", "rating {r}+", "over {r} stars", "rated {r}+", "{r} star minimum",
               "rating at least {r}"),
              ("minimum {r} stars", "{r}* and above", "no less than {r} stars"))
SORTS = {
    "price_asc": (("cheapest first", "sort by price low to high", "lowest price first", "price low to high",
                   "cheapest on top", "order by price ascending"), ("budget first",)),
    "price_desc": (("most expensive first", "sort by price high to low", "price high to low",
                    "highest price first", "order by price descending"), ("priciest first",)),
    "rating": (("best rated first", "top rated", "sort by rating", "highest rated first",
                "best reviewed first", "sort by stars"), ("highest reviews first",)),
    "newest": (("newest first", "latest arrivals", "sort by newest", "new arrivals first",
                "most recent first", "latest first"), ("just released",)),
    "popularity": (("most popular", "best sellers first", "sort by popularity", "bestsellers first",
                    "most bought first"), ("trending first",)),
}
DELIVERY = {
    "free_shipping": (("free shipping", "with free shipping", "ships free", "free delivery",
                       "shipping included", "free ship"), ("no shipping cost",)),
    "same_day": (("same day delivery", "delivered today", "same-day shipping", "get it today"), ("arrives today",)),
    "next_day": (("next day delivery", "overnight shipping", "next-day shipping", "delivered tomorrow",
                  "1 day shipping"), ("arrives tomorrow", "by tomorrow")),
    "two_day": (("2-day shipping", "two day delivery", "2 day delivery", "two-day shipping",
                 "delivered in 2 days"), ("within 2 days",)),
    "pickup": (("in-store pickup", "pick up in store", "store pickup", "collect in store"), ("click and collect",)),
}
IN_STOCK = _fam(("in stock", "in stock only", "available now", "in-stock", "currently available",
                 "only in-stock items", "only available items"), ("ready to ship", "not sold out"))
SIZE_FORMS = _fam(("size {s}", "sz {s}", "in size {s}", "sz{s}", "fits size {s}", "my size is {s}"), ("in a {s}", "size:{s}", "{s} size"))
MATERIAL_FORMS = _fam(("{m}", "made of {m}", "in {m}", "made from {m}", "{m} material",
                       "out of {m}"), ("{m}-made", "crafted from {m}"))
EXCLUDE_FORMS = _fam(("no {b}", "not {b}", "except {b}", "anything but {b}", "without {b}",
                      "not from {b}", "exclude {b}", "nothing from {b}", "but not {b}", "no {b} please"),
                     ("avoid {b}", "skip {b}", "excluding {b}"))
INCLUDE_FORMS = _fam(("{b} {x}", "{x} from {b}", "{x} by {b}", "{x} made by {b}", "only {b} {x}",
                      "{x} ({b})", "{x} brand {b}"), ("{b}-brand {x}", "{x}, {b} only"))
OPENERS = _fam(("", "", "", "", "looking for ", "i want ", "show me ", "find ", "need ", "searching for ",
                "do you have ", "shopping for ", "help me find ", "i need ", "where can i get ", "want "),
               ("any ", "got any ", "hunting for ", "can you find me ", "i'd like "))
COMPARE_FORMS = _fam(("compare {a} and {b} {x}", "{a} vs {b} {x}", "{x}: {a} or {b}?", "{a} vs. {b} {x}",
                      "{a} or {b} {x}?", "difference between {a} and {b} {x}", "{a} compared to {b} {x}"),
                     ("which is better, {a} or {b} {x}", "{a} versus {b} for {x}"))

# Multi-turn refinements: (kind, seen phrasings, held phrasings)
REFINE_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cheaper": (("cheaper", "something cheaper", "show cheaper ones", "cheaper options?",
                 "anything less expensive?"), ("too pricey, cheaper please",)),
    "color_swap": (("{c} instead", "what about in {c}", "show me {c} ones", "make it {c}",
                    "only {c} please"), ("got it in {c}?",)),
    "color_add": (("also in {c}", "{c} too", "add {c}", "{c} is fine too"), ("and {c} as well",)),
    "drop_brand": (("drop the brand filter", "any brand is fine", "brand doesn't matter",
                    "remove the brand"), ("forget the brand",)),
    "exclude": (("no {b} please", "not {b}", "without {b}", "remove {b}"), ("take out {b}",)),
    "price": (("make it under {p}", "under {p} instead", "max {p}", "budget is {p}"), ("keep it below {p}",)),
    "size": (("size {s} instead", "in {s} please", "sz {s}", "need size {s}"), ("actually sz {s}",)),
    "stock": (("only in stock", "just what's in stock", "in stock only please",
               "only available ones"), ("only ones that ship now",)),
    "sort": (("sort by rating", "best rated first", "top rated first", "highest rated please"), ("order by reviews",)),
    "delivery": (("with free shipping", "free shipping only", "only free delivery",
                  "must ship free"), ("no delivery fee",)),
}

SUPPORT_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "refund_window": (("how long do i have to return something?", "what is your refund policy?",
                       "can i get a refund after 2 weeks?", "return window?",
                       "can i return this?", "what's the return policy?"),
                      ("is there a time limit for refunds?", "how many days to send stuff back?")),
    "return_shipping": (("do i have to pay for return shipping?", "how do i send an item back?",
                         "is returning free?", "how do returns work?"), ("who pays postage on returns?", "return label?")),
    "order_status": (("where is my order {o}?", "status of order {o}", "has order {o} shipped yet?",
                      "tracking for {o}",
                      "where's {o}?", "track order {o}"), ("any update on {o}?", "order {o} still not here")),
    "order_status_noid": (("where is my order?", "has my package shipped?"), ("my stuff hasn't arrived",)),
    "payment_methods": (("what payment methods do you accept?", "can i pay with paypal?",
                         "do you take amex?", "can i pay by card?"), ("is apple pay ok?", "which cards work?")),
    "shipping_times": (("how long does shipping take?", "when will my stuff arrive?",
                        "how fast is delivery?", "how many days for shipping?"), ("standard shipping time?", "delivery estimate?")),
    "international": (("do you ship to canada?", "do you ship internationally?",
                       "can i order from germany?", "do you deliver to the uk?"), ("ship abroad?", "international delivery time?")),
    "cancel_order": (("cancel order {o}", "how do i cancel order {o}?", "i want to cancel {o}",
                      "please cancel {o}"),
                     ("please stop order {o}", "can {o} still be cancelled?")),
    "cancel_order_noid": (("how do i cancel an order?", "can i cancel my order?"), ("undo my purchase",)),
    "warranty": (("is there a warranty on headphones?", "what warranty do electronics have?",
                  "my laptop broke, is it covered?", "how long is the warranty?"), ("guarantee on gadgets?", "warranty claim?")),
}
SUPPORT_PREFIX = _fam(("", "", "hi, ", "hello, ", "quick question: ", "hey "), ("good morning, ", "excuse me, "))
SUPPORT_SUFFIX = _fam(("", "", " thanks", " thank you", " pls"), (" cheers", " asap"))


@dataclass
class Rendered:
    text: str
    families: list[str] = field(default_factory=list)


def _pick_form(rng: random.Random, split: Split, seen: tuple[str, ...], held: tuple[str, ...],
               family: str, fams: list[str], p_held: float = 0.5) -> str:
    use_held = split != "train" and held and rng.random() < p_held
    form = rng.choice(held if use_held else seen)
    fams.append(f"{family}:{'held' if use_held else 'seen'}")
    return form


def _price_amount(rng: random.Random, currency: str) -> float:
    if currency == "JPY":
        return float(rng.choice([3000, 5000, 8000, 10000, 12000, 15000, 20000, 30000]))
    base = rng.choice([15, 20, 25, 30, 40, 50, 60, 75, 80, 100, 120, 150, 200, 250, 300, 500, 800, 1200])
    if base > 20 and rng.random() < 0.15:
        return round(base - 0.01, 2)  # "49.99"-style prices
    return float(base)


def _fmt_amount(rng: random.Random, amount: float, fams: list[str], split: Split) -> str:
    if amount >= 1000 and amount % 1000 == 0 and rng.random() < 0.4:
        fams.append("amount:k")
        return f"{int(amount // 1000)}k"
    if amount >= 1000 and amount % 100 == 0 and rng.random() < 0.2:
        fams.append("amount:k_decimal")
        return f"{amount / 1000:g}k"
    fams.append("amount:plain")
    return f"{amount:g}" if not amount.is_integer() else str(int(amount))


def _money(rng: random.Random, split: Split, amount: float, currency: str, fams: list[str]) -> str:
    seen, held = CURRENCIES[currency]
    form = _pick_form(rng, split, seen, held, f"currency_{currency}", fams)
    return form.format(_fmt_amount(rng, amount, fams, split))


def _typo(rng: random.Random, word: str) -> str:
    letters = [i for i, ch in enumerate(word) if ch in string.ascii_lowercase]
    if len(letters) < 4:
        return word
    i = rng.choice(letters[1:-1])
    op = rng.random()
    if op < 0.4:
        return word[:i] + word[i + 1:]  # drop
    if op < 0.8 and i + 1 < len(word):
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]  # swap
    return word[:i] + word[i] + word[i:]  # double


class Generator:
    def __init__(self, split: Split, seed: int | None = None):
        self.split = split
        self.rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + (seed or 0))

    # --- search -----------------------------------------------------------
    def _product(self) -> tuple[str, str]:
        category = self.rng.choice(list(PRODUCTS))
        return category, PRODUCTS[category].pick(self.rng, self.split)

    def search(self) -> tuple[str, SearchParams, list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        category, product = self._product()
        p: dict[str, Any] = {"intent": "search", "keywords": product, "category": category}
        product_text = product
        if rng.random() < 0.12:
            words = product_text.split()
            j = rng.randrange(len(words))
            words[j] = _typo(rng, words[j])
            if " ".join(words) != product_text:
                fams.append("typo:product")
            product_text = " ".join(words)

        # Pre-noun modifiers: colour, material.
        pre: list[str] = []
        if category in COLORED and rng.random() < 0.5:
            n = 2 if rng.random() < 0.15 else 1
            colors = []
            while len(colors) < n:
                c = COLORS.pick(rng, split)
                if c not in colors:
                    colors.append(c)
            p["colors"] = colors
            shown = []
            for c in colors:
                if c in COLOR_ABBREV and rng.random() < 0.3:
                    shown.append(COLOR_ABBREV[c])
                    fams.append("color:abbrev")
                else:
                    shown.append(c)
                    fams.append("color:plain")
            pre.append(" or ".join(shown) if len(shown) > 1 else shown[0])
        material_suffix = ""
        if category in MATERIALS and rng.random() < 0.3:
            m = MATERIALS[category].pick(rng, split)
            p["material"] = m
            form = _pick_form(rng, split, MATERIAL_FORMS.seen, MATERIAL_FORMS.held, "material", fams)
            if form == "{m}":
                pre.append(m)
            else:
                material_suffix = form.format(m=m)
        noun = " ".join(pre + [product_text])

        if category in AUDIENCES_FOR and rng.random() < 0.35:
            aud = rng.choice(AUDIENCES_FOR[category])
            p["audience"] = aud
            seen, held = AUDIENCE_FORMS[aud]
            noun = _pick_form(rng, split, seen, held, "audience", fams).format(noun)

        brand_pool = BRANDS[category]
        if rng.random() < 0.35:
            b = brand_pool.pick(rng, split)
            p["brands_include"] = [b]
            shown = b
            if b in BRAND_TYPOS and rng.random() < 0.25:
                shown = BRAND_TYPOS[b]
                fams.append("typo:brand")
            form = _pick_form(rng, split, INCLUDE_FORMS.seen, INCLUDE_FORMS.held, "brand_include", fams)
            noun = form.format(b=shown, x=noun)

        parts: list[str] = [noun]
        if material_suffix:
            parts.append(material_suffix)
        if rng.random() < 0.2:
            excl = brand_pool.pick(rng, split)
            if excl not in p.get("brands_include", []):
                p["brands_exclude"] = [excl]
                parts.append(_pick_form(rng, split, EXCLUDE_FORMS.seen, EXCLUDE_FORMS.held,
                                        "negation", fams).format(b=excl))
        if category in SIZES and rng.random() < 0.4:
            s = SIZES[category].pick(rng, split)
            p["size"] = s
            shown = s
            if s in SIZE_WORDS and rng.random() < 0.4:
                shown = SIZE_WORDS[s]
                fams.append("size:word")
            parts.append(_pick_form(rng, split, SIZE_FORMS.seen, SIZE_FORMS.held, "size", fams).format(s=shown))
        if rng.random() < 0.5:
            cur = rng.choices(list(CURRENCY_WEIGHTS), weights=list(CURRENCY_WEIGHTS.values()))[0]
            p["currency"] = cur
            kind = rng.random()
            if kind < 0.6:
                a = _price_amount(rng, cur)
                p["price_max"] = a
                form = _pick_form(rng, split, PRICE_MAX.seen, PRICE_MAX.held, "price_max", fams)
                parts.append(form.format(p=_money(rng, split, a, cur, fams)))
            elif kind < 0.8:
                a = _price_amount(rng, cur)
                p["price_min"] = a
                form = _pick_form(rng, split, PRICE_MIN.seen, PRICE_MIN.held, "price_min", fams)
                parts.append(form.format(p=_money(rng, split, a, cur, fams)))
            else:
                a, b = sorted(rng.sample([_price_amount(rng, cur) for _ in range(4)], 2))
                if a == b:
                    b = a * 2
                p["price_min"], p["price_max"] = a, b
                form = _pick_form(rng, split, PRICE_RANGE.seen, PRICE_RANGE.held, "price_range", fams)
                parts.append(form.format(a=_fmt_amount(rng, a, fams, split), b=_money(rng, split, b, cur, fams)))
        if rng.random() < 0.2:
            r = rng.choice([3, 3.5, 4, 4.5]) if split == "train" else rng.choice([3, 3.5, 4, 4.2, 4.5, 4.8])
            p["min_rating"] = float(r)
            parts.append(_pick_form(rng, split, RATING.seen, RATING.held, "rating", fams).format(r=f"{r:g}"))
        if rng.random() < 0.2:
            s = rng.choice(list(SORTS))
            p["sort"] = s
            parts.append(_pick_form(rng, split, *SORTS[s], "sort", fams))
        if rng.random() < 0.2:
            d = rng.choice(list(DELIVERY))
            p["delivery"] = d
            parts.append(_pick_form(rng, split, *DELIVERY[d], "delivery", fams))
        if rng.random() < 0.15:
            p["in_stock"] = True
            parts.append(_pick_form(rng, split, IN_STOCK.seen, IN_STOCK.held, "in_stock", fams))

        head, tail = parts[0], parts[1:]
        rng.shuffle(tail)
        sep = rng.choice([" ", ", "])
        opener = _pick_form(rng, split, OPENERS.seen, OPENERS.held, "opener", fams)
        text = opener + sep.join([head] + tail)
        if rng.random() < 0.1:
            text = text.upper() if rng.random() < 0.3 else text.capitalize()
            fams.append("case")
        return text, SearchParams(**p), fams

    def compare(self) -> tuple[str, SearchParams, list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        category, product = self._product()
        pool = BRANDS[category]
        a = pool.pick(rng, split)
        b = pool.pick(rng, split)
        while b == a:
            b = rng.choice(pool.seen + pool.held)
        form = _pick_form(rng, split, COMPARE_FORMS.seen, COMPARE_FORMS.held, "compare", fams)
        params = SearchParams(intent="compare", keywords=product, category=category, brands_include=[a, b])
        return form.format(a=a, b=b, x=product), params, fams

    def refine(self) -> tuple[str, list[Turn], SearchParams, list[str], str]:
        """A follow-up turn whose gold merges the conversation so far."""
        rng, split = self.rng, self.split
        first_text, prev, fams = self.search()
        history = [Turn(role="user", content=first_text), Turn(role="assistant", content=canonical_json(prev))]
        if rng.random() < 0.3:  # two refinements deep
            text, prev, f2 = self._refine_step(prev)
            fams += f2
            history += [Turn(role="user", content=text), Turn(role="assistant", content=canonical_json(prev))]
        text, gold, f3 = self._refine_step(prev)
        return text, history, gold, fams + f3, f3[0].split(":")[0]

    def _refine_step(self, prev: SearchParams) -> tuple[str, SearchParams, list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        p = canonical_dict(prev)
        p["intent"] = "refine"
        category = p["category"]
        kinds = list(REFINE_FORMS)
        if category not in COLORED:
            kinds.remove("color_swap")
            kinds.remove("color_add")
        if not p.get("brands_include"):
            kinds.remove("drop_brand")
        if category not in SIZES:
            kinds.remove("size")
        kind = rng.choice(kinds)
        form = _pick_form(rng, split, *REFINE_FORMS[kind], f"refine_{kind}", fams)
        args: dict[str, str] = {}
        if kind == "cheaper":
            p["sort"] = "price_asc"
        elif kind in ("color_swap", "color_add"):
            c = COLORS.pick(rng, split)
            while c in p.get("colors", []):
                c = COLORS.pick(rng, split)
            p["colors"] = [c] if kind == "color_swap" else p.get("colors", []) + [c]
            args["c"] = c
        elif kind == "drop_brand":
            p.pop("brands_include", None)
        elif kind == "exclude":
            b = BRANDS[category].pick(rng, split)
            p["brands_exclude"] = sorted(set(p.get("brands_exclude", [])) | {b})
            p["brands_include"] = [x for x in p.get("brands_include", []) if x != b]
            args["b"] = b
        elif kind == "price":
            cur = p.get("currency", "USD")
            a = _price_amount(rng, cur)
            p["price_max"], p["currency"] = a, cur
            if p.get("price_min") is not None and p["price_min"] >= a:
                p.pop("price_min")
            args["p"] = _money(rng, split, a, cur, fams)
        elif kind == "size":
            s = SIZES[category].pick(rng, split)
            p["size"] = s
            args["s"] = s
        elif kind == "stock":
            p["in_stock"] = True
        elif kind == "sort":
            p["sort"] = "rating"
        elif kind == "delivery":
            p["delivery"] = "free_shipping"
        return form.format(**args), SearchParams(**p), fams

    # --- support ----------------------------------------------------------
    def support(self) -> tuple[str, dict[str, Any], list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        key = rng.choice(list(SUPPORT_FORMS))
        form = _pick_form(rng, split, *SUPPORT_FORMS[key], f"support_{key}", fams)
        topic = SupportTopic(key.removesuffix("_noid"))
        order_id = None
        if "{o}" in form:
            if rng.random() < 0.5:
                order_id = str(rng.randrange(10_000_000, 99_999_999))
            else:
                order_id = f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randrange(100, 999)}-{rng.randrange(1000, 9999)}"
            shown = order_id if rng.random() < 0.7 else "#" + order_id
            form = form.format(o=shown)
        pre = _pick_form(rng, split, SUPPORT_PREFIX.seen, SUPPORT_PREFIX.held, "support_prefix", fams)
        post = _pick_form(rng, split, SUPPORT_SUFFIX.seen, SUPPORT_SUFFIX.held, "support_suffix", fams)
        form = pre + form + post
        if rng.random() < 0.2:
            form = form.capitalize()
        return form, canonical_dict(support_reply(topic, order_id)), fams

    # --- one request --------------------------------------------------------
    def request(self, idx: int) -> Request:
        r = self.rng.random()
        history: list[Turn] = []
        if r < 0.2:
            query, gold_d, fams = self.support()
            task = "support"
            kind = "support"
        else:
            task = "search"
            if r < 0.25:
                query, gold, fams = self.compare()
                kind = "compare"
            elif r < 0.45:
                query, history, gold, fams, last_step = self.refine()
                kind = "refine"
            else:
                query, gold, fams = self.search()
                kind = "search"
            gold_d = canonical_dict(gold)
        meta: dict[str, Any] = {"kind": kind, "families": sorted(set(fams))}
        if kind == "refine":
            meta["last_step"] = last_step
        return Request(id=f"{self.split}-{idx:05d}", query=query, history=history, task=task, gold=gold_d,
                       meta=meta)


def generate(split: Split, n: int, seed: int | None = None) -> list[Request]:
    """``n`` requests for a split; the same (split, n, seed) always gives the same list."""
    gen = Generator(split, seed)
    out: list[Request] = []
    seen_queries: set[tuple] = set()
    idx = 0
    while len(out) < n:
        req = gen.request(idx)
        idx += 1
        key = (req.query, tuple(t.content for t in req.history))
        if key in seen_queries:
            continue
        seen_queries.add(key)
        req.id = f"{split}-{len(out):05d}"
        out.append(req)
    return out


DEFAULT_SIZES: dict[Split, int] = {"train": 4000, "dev": 200, "test": 400}
