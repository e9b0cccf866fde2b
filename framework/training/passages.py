"""Original paragraphs and code snippets written for this repository.

They are used only to build train prompts of the input-grounded category
(speculant.training.prompts); none of them is the demo's text.
"""

__all__ = ["PASSAGES", "QUESTIONS", "SNIPPETS", "RENAMES"]


PASSAGES: list[str] = [
    # 0
    (
        "The Millbrook footbridge over the Tarrow River was finished in May 1998 after two years "
        "of work. It is 64 meters long and was built from local oak and galvanized steel at a "
        "cost of about 1.2 million dollars. Before it opened, people living on the east bank had "
        "to walk nearly three kilometers to the road bridge at Fenley to reach the town's only "
        "school. Today roughly 900 pedestrians and cyclists cross it on an ordinary weekday."
    ),
    # 1
    (
        "The Danube is the second-longest river in Europe, running about 2,850 kilometers from "
        "the Black Forest in southwestern Germany to the Black Sea. Along the way it passes "
        "through or borders ten countries, more than any other river in the world. Four national "
        "capitals stand on its banks: Vienna, Bratislava, Budapest and Belgrade. Near its mouth "
        "the river splits into a wide delta in Romania and Ukraine that is home to over 300 "
        "species of birds."
    ),
    # 2
    (
        "Mount Kilimanjaro in northern Tanzania rises to 5,895 meters, making it the highest peak "
        "in Africa. Climbers usually take between five and nine days to reach Uhuru Peak, its "
        "summit, because a slower ascent gives the body time to adjust to the thin air. The "
        "trails pass through several distinct zones, from farmland and rainforest to alpine "
        "desert and, finally, snowfields near the top. Roughly 35,000 people attempt the climb "
        "each year."
    ),
    # 3
    (
        "Tasmania is an island state of Australia, separated from the mainland by the Bass "
        "Strait, which is about 240 kilometers wide. The island covers roughly 68,000 square "
        "kilometers, and nearly half of its land lies within national parks and other protected "
        "areas. Its capital, Hobart, was founded in 1804 and is the second-oldest capital city in "
        "the country after Sydney. Passenger ferries cross the strait overnight from the port of "
        "Devonport."
    ),
    # 4
    (
        "The Great Fire of London began in the early hours of 2 September 1666 in a bakery on "
        "Pudding Lane. Driven by a strong easterly wind, it burned for four days and destroyed "
        "about 13,200 houses, 87 parish churches and the old St Paul's Cathedral. Although the "
        "official death toll was low, tens of thousands of people lost their homes. The "
        "rebuilding that followed led to stricter rules requiring new buildings to be made of "
        "brick or stone."
    ),
    # 5
    (
        "Bread dough rises because yeast feeds on the sugars in flour and releases carbon dioxide "
        "gas. The gas becomes trapped in a stretchy network of gluten, which forms when wheat "
        "proteins are mixed with water and kneaded. Yeast works best at temperatures between "
        "about 24 and 27 degrees Celsius, so dough left in a cold kitchen may take twice as long "
        "to double in size. In the oven, the heat kills the yeast and sets the structure of the "
        "loaf."
    ),
    # 6
    (
        "The QR code was invented in 1994 by Masahiro Hara, an engineer at the Japanese company "
        "Denso Wave. It was first designed to track car parts moving through factories, where "
        "ordinary barcodes could not hold enough information. A single QR code can store up to "
        "7,089 numeric digits, and it can still be read even when part of the pattern is damaged. "
        "Denso Wave chose not to enforce its patent, which helped the format spread around the "
        "world."
    ),
    # 7
    (
        "The common octopus has three hearts: two pump blood through the gills, and the third "
        "sends it around the rest of the body. Its blood is blue because it relies on a "
        "copper-based protein called hemocyanin rather than iron-based hemoglobin. About two "
        "thirds of an octopus's neurons are located in its eight arms, which can react to touch "
        "and taste on their own. Most species live only one to two years."
    ),
    # 8
    (
        "According to a popular story, the pizza Margherita was created in Naples in June 1889 by "
        "a cook named Raffaele Esposito. He is said to have prepared it for Queen Margherita of "
        "Savoy during her visit to the city. The toppings of tomato, mozzarella and fresh basil "
        "were chosen to match the red, white and green of the Italian flag. Historians still "
        "debate how much of the tale is true, but the name has stuck for well over a century."
    ),
    # 9
    (
        "The marathon distance of 42.195 kilometers was not fixed until 1921. At the first modern "
        "Olympic Games in 1896 the race was about 40 kilometers, and the length changed from one "
        "event to the next. The odd final figure comes from the 1908 London Olympics, where the "
        "course was laid out from Windsor Castle to the royal box in the stadium. Today more than "
        "800 marathons are held around the world every year."
    ),
    # 10
    (
        "In the summer of 2019, forty students from Elmsford High School painted a mural along "
        "the retaining wall of Canal Street. The finished work is 38 meters long and shows the "
        "history of the town, from the first grain mill in 1832 to the opening of the railway "
        "station in 1907. The project was led by local artist Dana Whitcombe and paid for by a "
        "grant of 12,000 dollars from the county arts council."
    ),
    # 11
    (
        "The Saturday farmers market in Brackenridge had its busiest year on record in 2023. "
        "Organizers counted 46 regular stalls, up from 31 the year before, and estimated total "
        "sales at around 410,000 dollars. Vegetables and eggs remained the best sellers, but "
        "stalls selling bread, cheese and cut flowers grew fastest. The market runs from April to "
        "November in the parking lot behind the old courthouse."
    ),
    # 12
    (
        "The public library in Oakhurst will stay open until 8 p.m. on Tuesdays and Thursdays "
        "starting on March 4, the town council announced this week. Until now the building has "
        "closed at 5 p.m. every weekday. Head librarian Maria Santos said the change responds to "
        "a survey in which 62 percent of residents asked for evening hours. Two part-time staff "
        "members will be hired to cover the extra shifts."
    ),
    # 13
    (
        "The Glenvar Valley Railway is a narrow-gauge line that climbs 27 kilometers from the "
        "market town of Ashby to the mountain village of Corran. The journey takes about an hour "
        "and forty minutes and crosses eleven stone viaducts built between 1889 and 1894. Steam "
        "locomotives run on the line every weekend from May to September. Passengers are advised "
        "to sit on the left side of the train for the best views of Loch Varrin."
    ),
    # 14
    (
        "Health agencies recommend washing hands with soap and water for at least 20 seconds, "
        "roughly the time it takes to hum the birthday song twice. Soap molecules have one end "
        "that attracts water and another that attracts oils, which lets them lift dirt and germs "
        "off the skin so they can be rinsed away. Drying hands thoroughly matters too, since "
        "germs spread more easily from wet skin. Hand sanitizer should contain at least 60 "
        "percent alcohol to be effective."
    ),
    # 15
    (
        "Lake-effect snow forms when cold, dry air passes over the warmer water of a large lake. "
        "The air picks up moisture and heat from the surface, rises, and then drops the moisture "
        "as snow once it reaches land. Towns downwind of the Great Lakes, such as Buffalo in New "
        "York, can receive more than a meter of snow in a single storm while places 30 "
        "kilometers away see almost none. The effect is strongest in November and December, "
        "before the lakes freeze."
    ),
    # 16
    (
        "The modern safety pin was patented in April 1849 by Walter Hunt, a mechanic living in "
        "New York. According to his own account, he designed it in about three hours while "
        "twisting a piece of wire and trying to think of a way to pay off a debt of 15 dollars. "
        "Hunt sold the rights to his invention for 400 dollars, and the buyer went on to earn far "
        "more from it. The basic design, with a coiled spring and a clasp, has changed little "
        "since then."
    ),
    # 17
    (
        "Lake Baikal in southern Siberia is the deepest lake on Earth, reaching 1,642 meters at "
        "its lowest point. It holds roughly a fifth of all the unfrozen fresh water found on the "
        "planet's surface. Scientists believe the lake is around 25 million years old, which also "
        "makes it one of the oldest. It is home to the Baikal seal, one of the few seal species "
        "that lives only in fresh water."
    ),
    # 18
    (
        "The Mekong River begins high on the Tibetan Plateau and travels about 4,900 kilometers "
        "before reaching the South China Sea. It flows through or along the borders of China, "
        "Myanmar, Laos, Thailand, Cambodia and Vietnam. In Vietnam the river divides into many "
        "channels, and the region is known locally as the Nine Dragon River Delta. Tens of "
        "millions of people depend on the Mekong for rice farming, transport and food."
    ),
    # 19
    (
        "Kyoto served as the capital of Japan for more than a thousand years, from 794 until "
        "1868, when the emperor moved to Tokyo. The city has around 1,600 Buddhist temples and "
        "some 400 Shinto shrines. Seventeen of its historic sites are listed together as a UNESCO "
        "World Heritage Site. Kyoto was largely spared from bombing during the Second World War, "
        "so many of its wooden buildings survive today."
    ),
    # 20
    (
        "Work to repave Main Street in Dunmore will begin on June 10 and is expected to last seven "
        "weeks. The project covers the 1.4-kilometer stretch between the post office and the "
        "Riverside Road roundabout. During construction, traffic will be reduced to a single lane "
        "and parking will be banned on the north side of the street. The council has set aside "
        "860,000 dollars for the work, which will also add two new pedestrian crossings."
    ),
    # 21
    (
        "The Rosetta Stone was found in July 1799 by French soldiers near the town of Rashid, "
        "known to Europeans as Rosetta, in the Nile Delta. The slab carries the same decree "
        "written three times: in hieroglyphs, in Demotic script and in ancient Greek. Because "
        "scholars could read the Greek, the stone became a key to understanding hieroglyphs. "
        "Jean-Francois Champollion announced his breakthrough in deciphering them in 1822."
    ),
    # 22
    (
        "A rainbow appears when sunlight enters raindrops, bends, reflects off the back of each "
        "drop and bends again on the way out. Because each color bends by a slightly different "
        "amount, the white light spreads into a band running from red on the outside to violet "
        "on the inside. The main bow always sits at an angle of about 42 degrees from the point "
        "directly opposite the sun. That is why rainbows are most often seen in the early morning "
        "or late afternoon."
    ),
    # 23
    (
        "The first text message was sent on 3 December 1992 by Neil Papworth, a 22-year-old "
        "engineer working in Britain. He typed it on a computer because mobile phones at the time "
        "had no keyboards, and sent it to a phone belonging to a Vodafone director. The message "
        "simply read 'Merry Christmas'. Within ten years, people around the world were sending "
        "billions of text messages every month."
    ),
    # 24
    (
        "The Arctic tern makes the longest known migration of any animal. Each year it flies from "
        "its breeding grounds in the Arctic to the waters around Antarctica and back again, a "
        "round trip that tracking studies put at roughly 70,000 kilometers. Because it follows "
        "the summer in both hemispheres, it sees more daylight than any other creature. A tern "
        "living for 30 years may travel a distance equal to about three trips to the Moon and "
        "back."
    ),
    # 25
    (
        "The dairy cooperative in the alpine village of Santa Lena was founded in 1921 by "
        "fourteen farming families. It still makes a single hard cheese, aged for at least ten "
        "months in a stone cellar beneath the old schoolhouse. Each wheel weighs about 35 "
        "kilograms and needs roughly 400 liters of milk. Last year the cooperative sold 2,300 "
        "wheels, most of them to shops in nearby towns and to hikers passing through in summer."
    ),
    # 26
    (
        "Redfield Rovers, a youth football club in the town of Hallam, is celebrating its 50th "
        "anniversary this season. The club was started in 1974 by a schoolteacher, Peter Okafor, "
        "with a single team of under-12 boys. It now runs 22 teams for boys and girls aged six to "
        "eighteen and has more than 380 registered players. A celebration match against former "
        "members is planned for August 17 at Millfield Park."
    ),
    # 27
    (
        "The Sydney Opera House was designed by the Danish architect Jorn Utzon, whose entry won "
        "an international competition in 1957. Construction began in 1959 and ran far over "
        "budget and schedule, and Utzon left the project in 1966 before it was finished. The "
        "building finally opened in October 1973. Its famous roof shells are covered with more "
        "than one million tiles in white and cream."
    ),
    # 28
    (
        "Bluefern Coffee, a small roaster based in the harbor town of Caddington, will open a "
        "second roasting site in September. The company started in 2016 in a converted garage "
        "and now supplies about 140 cafes and grocery stores. Its new building on Ferry Lane will "
        "triple production to around 90 tonnes of coffee a year. Owner Lucy Marsh said the "
        "expansion will create eleven new jobs."
    ),
    # 29
    (
        "The Ridgeback Trail runs 46 kilometers along the crest of the Carrow Hills, from the "
        "village of Stanway to the coastal town of Penhale. Most walkers complete it in three "
        "days, staying overnight at the huts at Crowpoint and Little Tarn. The highest point on "
        "the route is Gallows Knoll, at 712 meters. The trail is marked with yellow posts and is "
        "usually free of snow from late April to October."
    ),
    # 30
    (
        "Sunscreen is labeled with a sun protection factor, or SPF, which describes how well it "
        "blocks the ultraviolet rays that cause sunburn. A product rated SPF 30 filters out about "
        "97 percent of those rays, while SPF 50 filters about 98 percent. Dermatologists advise "
        "applying around two milligrams per square centimeter of skin, which for an adult's whole "
        "body is roughly a shot glass full. Sunscreen should be reapplied every two hours and "
        "after swimming."
    ),
    # 31
    (
        "A short but violent hailstorm struck the town of Wexley on the afternoon of July 22. "
        "Hailstones up to four centimeters across fell for about twelve minutes, breaking windows "
        "and denting cars across the southern half of town. The roof of the community sports "
        "hall was damaged, and the building will remain closed for at least three weeks. No "
        "injuries were reported, but insurers have already received more than 600 claims."
    ),
    # 32
    (
        "The stethoscope was invented in 1816 by Rene Laennec, a French doctor working in Paris. "
        "Uncomfortable about pressing his ear to a young patient's chest, he rolled a sheet of "
        "paper into a tube and found that he could hear the heartbeat more clearly. He later "
        "built a wooden version about 25 centimeters long. Laennec's instrument made it possible "
        "to diagnose many lung and heart conditions by sound alone."
    ),
    # 33
    (
        "The Atacama Desert in northern Chile is one of the driest places on Earth. Some weather "
        "stations there have recorded average rainfall of less than one millimeter a year. "
        "Because the air is so dry and clear, the region hosts several major observatories, "
        "including the Atacama Large Millimeter Array, which sits at about 5,000 meters above sea "
        "level. Scientists have also used its soil to test equipment meant for Mars."
    ),
    # 34
    (
        "Madagascar, off the southeastern coast of Africa, is the fourth-largest island in the "
        "world. It separated from the Indian subcontinent around 88 million years ago, and its "
        "plants and animals have evolved in isolation ever since. As a result, about 90 percent "
        "of its wildlife is found nowhere else. The island is best known for its lemurs, of which "
        "more than 100 species and subspecies have been described."
    ),
    # 35
    (
        "The first transcontinental railroad in the United States was completed on 10 May 1869 "
        "at Promontory Summit in Utah. There, the tracks of the Central Pacific, built eastward "
        "from California, met those of the Union Pacific, built westward from Nebraska. A "
        "ceremonial golden spike was driven to join the two lines. The journey from coast to "
        "coast, which had taken months by wagon, could now be made in about a week."
    ),
    # 36
    (
        "A metal spoon and a wooden spoon left in the same room are the same temperature, yet the "
        "metal one feels colder to the touch. This happens because metal conducts heat much "
        "faster than wood, so it draws warmth away from your skin more quickly. Your nerves sense "
        "the rate at which heat leaves your body, not the temperature of the object itself. "
        "Copper, for example, conducts heat more than two thousand times better than pine."
    ),
    # 37
    (
        "Shelfmate, an app developed by two former students from Carlton University, lets library "
        "users scan the barcode on a book to see whether nearby branches have other copies. The "
        "app launched in January with twelve libraries in the Wessex region and has since been "
        "downloaded about 48,000 times. Its creators, Amir Haddad and Jo Lin, plan to add support "
        "for audiobooks by the end of the year."
    ),
    # 38
    (
        "The Hollins Wildlife Rescue Center released five young barn owls back into the wild "
        "last week. The birds had been found in April in a collapsed barn near the village of "
        "Kestle and were raised by volunteers for eleven weeks. Each owl was fitted with a small "
        "leg ring so it can be identified if found again. The center treats about 1,900 injured "
        "or orphaned animals every year and relies almost entirely on donations."
    ),
    # 39
    (
        "Kimchi is a Korean dish of salted and fermented vegetables, most often napa cabbage and "
        "radish, seasoned with chili pepper, garlic, ginger and fish sauce. Many families still "
        "take part in kimjang, the tradition of making large batches in late autumn to last "
        "through the winter. In 2013 kimjang was added to UNESCO's list of the Intangible "
        "Cultural Heritage of Humanity. Some households prepare more than a hundred heads of "
        "cabbage in a single weekend."
    ),
    # 40
    (
        "The North County Open chess tournament drew 164 players to the Lindley Community Center "
        "over the weekend of October 5. Competitors ranged in age from seven to eighty-one. The "
        "top section was won by 16-year-old Priya Raman, who scored six points from seven games "
        "and did not lose a single match. Organizers said entries had risen by almost a third "
        "since last year."
    ),
    # 41
    (
        "The Larkspur Players will stage 'The Lighthouse Keeper's Daughter', a new play by local "
        "writer Helen Ashe, at the Town Hall theater from November 8 to 16. The cast of fourteen "
        "includes three actors who are performing on stage for the first time. Rehearsals began "
        "in August, and the set was built by volunteers using timber from the old harbor pier. "
        "Tickets cost 12 dollars for adults and 6 dollars for children."
    ),
    # 42
    (
        "The former Grayson shoe factory in Milton Falls will reopen next spring under new "
        "ownership. The factory closed in 2009 after 84 years of production, putting about 300 "
        "people out of work. Its new owner, a company called Stride Works, plans to make hiking "
        "boots there and expects to employ 70 people in the first year. The town has agreed to "
        "reduce property taxes on the site for five years."
    ),
    # 43
    (
        "A new playground opened on Saturday at Hawthorn Park in the village of Upper Byford. It "
        "includes a rope climbing frame, a wheelchair-accessible roundabout and a sandpit shaded "
        "by sails. The project cost 95,000 dollars, of which about a third was raised by parents "
        "through bake sales, a sponsored run and a summer fair. The old wooden play equipment, "
        "installed in 1987, had been closed for safety reasons since last autumn."
    ),
    # 44
    (
        "The Trans-Siberian Railway links Moscow with Vladivostok on the Pacific coast, a "
        "distance of about 9,289 kilometers. It is the longest railway line in the world and "
        "crosses seven time zones. Construction started in 1891, and the full route entirely on "
        "Russian territory was completed in 1916. Without changing trains, a passenger can travel "
        "from one end to the other in roughly six days."
    ),
    # 45
    (
        "The town of Pell Harbor has launched a free walking program for residents over sixty. "
        "Groups meet at the library steps at 9 a.m. on Mondays, Wednesdays and Fridays and follow "
        "one of three marked routes between two and five kilometers long. The program is run by "
        "retired nurse Ellen Brody and a team of eight volunteer leaders. Since it began in "
        "February, more than 120 people have signed up."
    ),
    # 46
    (
        "San Francisco is famous for its summer fog, which locals have nicknamed Karl. In June, "
        "July and August, warm inland air draws cool, moist air in from the Pacific Ocean, and "
        "the moisture condenses into thick fog as it passes over the cold coastal water. The fog "
        "often pours through the Golden Gate in the afternoon and can lower temperatures by ten "
        "degrees or more within an hour. September and October are often the city's warmest "
        "months."
    ),
    # 47
    (
        "The zipper as we know it was developed by Gideon Sundback, a Swedish-American engineer, "
        "who patented his 'separable fastener' in 1917 after improving an earlier design. Early "
        "versions were used mainly on boots and tobacco pouches. The name 'zipper' was "
        "popularized in 1923 by the B.F. Goodrich company, which used the fasteners on rubber "
        "galoshes. It took until the 1930s for zippers to become common on trousers and jackets."
    ),
    # 48
    (
        "The Andes form the longest continental mountain range in the world, stretching about "
        "7,000 kilometers along the western edge of South America. They pass through seven "
        "countries, from Venezuela in the north to Chile and Argentina in the south. The highest "
        "summit is Aconcagua in Argentina, at 6,961 meters. Potatoes were first domesticated in "
        "the Andes, near Lake Titicaca, several thousand years ago."
    ),
    # 49
    (
        "Port Alder grew up around a natural harbor on the northern coast, sheltered from storms "
        "by a long sandbar called the Spit. The town was granted a charter in 1763 and today has "
        "about 14,000 residents. Its harbor still handles timber shipments and a ferry to the "
        "Skerry Islands, which runs four times a day in summer. A new seawall, finished in 2021, "
        "protects the old warehouses along Quay Street from high tides."
    ),
    # 50
    (
        "The Gannet Head lighthouse, first lit in 1858, shone again last month after a three-year "
        "restoration. Volunteers repaired the iron lantern room, repainted the 31-meter tower and "
        "installed a modern LED light that can be seen from 30 kilometers at sea. The lighthouse "
        "was automated in 1974, and its last keeper, Thomas Reeve, attended the relighting "
        "ceremony at the age of 91."
    ),
    # 51
    (
        "Most substances are denser as solids than as liquids, but water is an exception. When "
        "water freezes, its molecules lock into an open, six-sided pattern that takes up about 9 "
        "percent more space than liquid water. This makes ice less dense, so it floats. Because "
        "ice forms on the surface of lakes and ponds, it insulates the water below, allowing fish "
        "and other life to survive the winter."
    ),
    # 52
    (
        "The first product scanned with a barcode at a store checkout was a ten-pack of Wrigley's "
        "chewing gum, on 26 June 1974. It happened at a Marsh supermarket in Troy, Ohio. The code "
        "used, the Universal Product Code, had been chosen by a grocery industry committee the "
        "year before. The pack of gum is now kept at the Smithsonian's National Museum of "
        "American History in Washington."
    ),
    # 53
    (
        "Hummingbirds are the only birds that can fly backward and hover in place for long "
        "periods. To do so, some species beat their wings up to 80 times a second. Their hearts "
        "can beat more than 1,200 times a minute during flight, and they must feed every ten to "
        "fifteen minutes to keep going. There are more than 300 species, all found only in the "
        "Americas. The smallest, which lives in Cuba, weighs less than two grams."
    ),
    # 54
    (
        "Margaret Doyle, 74, won the annual pie contest at the Farrow County Fair for the fourth "
        "time on Sunday. Her entry, a rhubarb and ginger pie, was chosen from 58 entries by a "
        "panel of three judges. Doyle said the recipe came from her grandmother, who ran a bakery "
        "on Elm Street in the 1940s. The runner-up was 12-year-old Sam Cutler with a blueberry "
        "crumble pie."
    ),
    # 55
    (
        "The Tour of the Meren Valley, a one-day cycling race, will take place on Sunday, "
        "September 14. Riders will cover 148 kilometers, starting and finishing in the town of "
        "Orlin and climbing the Col de Savet twice. About 190 professional and amateur cyclists "
        "have entered. Roads along the route will be closed from 8 a.m. to 4 p.m., and spectators "
        "are encouraged to watch from the village of Brey, where the riders will pass three times."
    ),
    # 56
    (
        "The Ferrisburg Museum of Local History has opened an exhibition of 42 handmade quilts, "
        "the oldest dating from 1846. Many were made by women in farming families and include "
        "patches cut from worn clothing, flour sacks and wedding dresses. One quilt records the "
        "names of 96 residents who served in the Civil War. The exhibition runs until January 12, "
        "and entry is free on the first Sunday of each month."
    ),
    # 57
    (
        "Visitor numbers in the coastal town of Saltmere rose to about 310,000 last year, up 14 "
        "percent from the year before, according to the regional tourism office. The average "
        "visitor stayed 2.6 nights and spent around 95 dollars a day. July remained the busiest "
        "month, but the strongest growth came in October, when a new food festival drew large "
        "crowds. Local hotels reported occupancy rates above 80 percent for five months of the "
        "year."
    ),
    # 58
    (
        "Pupils at Brindle Primary School have raised 3,400 dollars to buy a telescope for their "
        "new astronomy club. The money came from a bake sale, a sponsored silence and a raffle "
        "with prizes donated by local shops. The club, started by science teacher Owen Pryce, "
        "meets every second Thursday evening in the school field. Its first target, weather "
        "permitting, will be the rings of Saturn."
    ),
    # 59
    (
        "A new ferry route will connect the mainland port of Kinloch with the islands of Mora and "
        "Inish Beg starting on May 1. The 64-meter vessel, named Saint Brigid, can carry 240 "
        "passengers and 36 cars. The crossing to Mora takes 50 minutes, and the boat continues to "
        "Inish Beg in a further 35 minutes. In winter the service will run twice daily, rising to "
        "five sailings a day from June to August."
    ),
    # 60
    (
        "Greenway Pharmacy in Tolbridge is offering free blood pressure checks every Wednesday "
        "during October. The checks take about ten minutes and are carried out by pharmacist "
        "Ravi Desai in a private consultation room. High blood pressure often causes no "
        "symptoms, and Desai estimates that about one in four adults who come in will be advised "
        "to see a doctor. No appointment is needed."
    ),
    # 61
    (
        "The southwest monsoon brings most of India's rain between June and September. It "
        "usually reaches the southern state of Kerala around June 1 and spreads across the "
        "country over the following six weeks. These four months supply roughly 70 percent of "
        "the nation's annual rainfall, and a weak monsoon can cut harvests of rice, cotton and "
        "sugarcane. Weather forecasters watch its arrival date closely each year."
    ),
    # 62
    (
        "The Post-it Note grew out of a failed experiment. In 1968 Spencer Silver, a chemist at "
        "3M, created an adhesive that stuck lightly and could be peeled off without leaving "
        "marks. Years later his colleague Art Fry used it to keep paper bookmarks from falling "
        "out of his hymn book at church. After test marketing, the notes went on sale across the "
        "United States in 1980, in their now familiar canary yellow."
    ),
    # 63
    (
        "The Sahara is the largest hot desert in the world, covering about 9 million square "
        "kilometers of northern Africa, an area nearly as large as the United States. Only a "
        "small part of it is covered by sand dunes; most is rocky plateau and gravel plain. "
        "Daytime temperatures in summer can exceed 45 degrees Celsius, but nights can be "
        "surprisingly cold. Around 6,000 years ago, much of the Sahara was green grassland with "
        "lakes."
    ),
    # 64
    (
        "The island of Kesby lies eight kilometers off the west coast and has a population of "
        "just 230. It has one shop, one primary school with nineteen pupils and a small airstrip "
        "used by a twice-weekly flight. Electricity comes mainly from three wind turbines "
        "installed in 2015. In summer the island's population roughly doubles as visitors arrive "
        "to walk its cliffs and watch puffins."
    ),
    # 65
    (
        "The town of Carver's Ford began in 1794, when brothers Amos and Jacob Carver built a "
        "sawmill where the old trail crossed the Wendle River. By 1830 the settlement had a "
        "church, a tannery and about 400 inhabitants. The arrival of the railway in 1868 turned "
        "it into a busy market center for the surrounding farms. The original mill burned down "
        "in 1901, but its stone foundations can still be seen beside the river path."
    ),
    # 66
    (
        "A refrigerator keeps food cold by moving heat from the inside to the outside. A liquid "
        "called a refrigerant flows through coils inside the fridge, where it evaporates and "
        "absorbs heat. A compressor then squeezes the vapor, raising its temperature, and pushes "
        "it through coils on the back of the appliance, where it releases that heat into the "
        "kitchen. Most fridges are set to keep their main compartment between 3 and 5 degrees "
        "Celsius."
    ),
    # 67
    (
        "Free public Wi-Fi is now available in Riverside Park in Alston after the town installed "
        "six wireless access points along the main paths. The network covers the playground, the "
        "bandstand and the outdoor cafe, and allows each user up to two hours of use per day. The "
        "project cost about 28,000 dollars and was funded by a state digital access grant. "
        "Officials plan to extend coverage to the sports fields next year."
    ),
    # 68
    (
        "Emperor penguins are the largest penguins, standing up to about 1.2 meters tall and "
        "weighing as much as 40 kilograms. They breed during the Antarctic winter, when "
        "temperatures can fall below minus 40 degrees Celsius. After the female lays a single "
        "egg, the male balances it on his feet under a fold of skin for about two months while "
        "the female feeds at sea. During that time the males huddle together in large groups to "
        "stay warm."
    ),
    # 69
    (
        "The Linden Street community garden harvested more than 1,100 kilograms of vegetables "
        "this year, its fifth season. The garden has 36 raised beds, each tended by a local "
        "household, and a shared herb patch near the entrance. About a quarter of the harvest was "
        "donated to the Westbury food bank. Tomatoes, squash and green beans were the most "
        "productive crops, while an early frost in September damaged the peppers."
    ),
    # 70
    (
        "The Cranford Otters swimming club will move into the new 25-meter pool at the Cranford "
        "Leisure Center in January. The club, which has 210 members, has trained for the past six "
        "years at a school pool twelve kilometers away. The new pool has eight lanes, a movable "
        "floor for teaching younger children and seating for 300 spectators. The club plans to "
        "host its first regional gala there in April."
    ),
    # 71
    (
        "The Aldwick Symphony Orchestra has commissioned a new piece from composer Tomasz Wrobel "
        "to mark the orchestra's centenary in 2025. The work, titled 'River Songs', will last "
        "about 25 minutes and include a part for a children's choir of 60 voices. It will have "
        "its premiere on March 22 at the Corn Exchange. The orchestra was founded in 1925 by a "
        "group of railway workers who met to play in the evenings."
    ),
    # 72
    (
        "Pemberton Hardware on Market Square is celebrating 100 years in business this month. It "
        "was opened in 1924 by Arthur Pemberton and is now run by his great-granddaughter, "
        "Claire. The shop stocks around 12,000 different items, from nails sold by weight to "
        "garden tools and paint. Claire Pemberton said the store's survival owes much to staff "
        "who have worked there for decades and know where everything is kept."
    ),
    # 73
    (
        "A cat that went missing from a house in Thornby more than two years ago has been "
        "returned to its owners. Mittens, a grey tabby, was found 90 kilometers away in the town "
        "of Easterleigh, where a veterinary clinic scanned her microchip. Her owner, Janet Cole, "
        "said the family had almost given up hope. How the cat traveled so far remains a mystery, "
        "though neighbors suspect she climbed into a delivery van."
    ),
    # 74
    (
        "A week on the Arley Vale Canal is a slow way to travel: boats are limited to 6 "
        "kilometers an hour, and the 72-kilometer route from Hadley to Stourmouth includes 38 "
        "locks. Most hire boats sleep four to six people and have a small kitchen, a shower and "
        "a wood-burning stove. First-time boaters receive a one-hour lesson before setting off. "
        "Pubs and village shops along the towpath make it easy to restock supplies."
    ),
    # 75
    (
        "Every child at the four primary schools in Marlow District will receive a free eye test "
        "this term, under a program funded by a local charity. Last year a similar pilot at one "
        "school found that 41 of 260 pupils needed glasses, and most of their parents had not "
        "known. Optometrist Grace Lim and two assistants will carry out the tests using portable "
        "equipment. Families will receive the results by letter within two weeks."
    ),
    # 76
    (
        "The town of Ferndale recorded its highest temperature ever on Tuesday, when the "
        "thermometer at the airport weather station reached 39.4 degrees Celsius. The previous "
        "record, 38.1 degrees, had stood since August 1976. The town opened two cooling centers "
        "at the library and the community hall, and the council asked residents to check on "
        "elderly neighbors. Forecasters expect cooler air to arrive by the weekend."
    ),
    # 77
    (
        "The QWERTY keyboard layout comes from the typewriter designed by Christopher Latham "
        "Sholes, a printer and newspaper editor from Milwaukee. Sholes and his partners received "
        "a patent in 1868, and the arms maker E. Remington and Sons began producing the machine "
        "in 1873. The layout went through several versions before settling into the familiar "
        "arrangement. It was later carried over to computer keyboards and is still used by most "
        "English speakers today."
    ),
    # 78
    (
        "Victoria Falls lies on the Zambezi River, on the border between Zambia and Zimbabwe. It "
        "is about 1,700 meters wide and 108 meters high, making it one of the largest curtains "
        "of falling water on Earth. The local name, Mosi-oa-Tunya, means 'the smoke that "
        "thunders', after the spray that can be seen from many kilometers away. The Scottish "
        "explorer David Livingstone named the falls after Queen Victoria in 1855."
    ),
    # 79
    (
        "The old town of Castel Rovo sits on a ridge 180 meters above the railway station in the "
        "valley below. Since 1893 the two have been linked by a funicular railway, whose two cars "
        "are balanced by a steel cable so that one rises as the other descends. The ride takes "
        "just under four minutes and climbs slopes as steep as 28 percent. About a million "
        "passengers use the funicular each year, many of them students going to the upper town."
    ),
    # 80
    (
        "The first modern Olympic Games were held in Athens in April 1896. About 241 athletes, "
        "all men, from 14 nations competed in 43 events, including athletics, cycling, fencing, "
        "gymnastics, shooting, swimming, tennis, weightlifting and wrestling. The most celebrated "
        "winner was the Greek runner Spyridon Louis, who won the marathon. The Games were the "
        "idea of the French educator Pierre de Coubertin."
    ),
    # 81
    (
        "The sky looks blue because of the way sunlight interacts with the gases in the "
        "atmosphere. Sunlight contains all colors, but shorter wavelengths, such as blue and "
        "violet, are scattered far more strongly by air molecules than longer red wavelengths. "
        "This effect is called Rayleigh scattering, after the British physicist Lord Rayleigh, "
        "who described it in the 1870s. At sunset, light travels through more air, so most blue "
        "is scattered away and reds and oranges remain."
    ),
    # 82
    (
        "The Westfield Cricket Club is testing four robotic lawnmowers on its outfield this "
        "summer. The battery-powered machines follow a boundary wire and cut the grass a little "
        "every day instead of once a week, which groundsman Neil Barker says produces a thicker, "
        "more even surface. Each mower can cover about 5,000 square meters and returns to its "
        "charging station on its own. The club will decide in October whether to buy the "
        "machines."
    ),
    # 83
    (
        "Beavers have returned to the River Lynn for the first time in more than 300 years, "
        "according to the regional wildlife trust. A family of five was released in March into a "
        "fenced area of wet woodland near the village of Ashcombe. Within three months the "
        "animals had built two dams, creating ponds that already attract frogs, dragonflies and "
        "herons. Scientists will monitor whether the dams help reduce flooding in the town "
        "downstream."
    ),
    # 84
    (
        "Since opening in 2018, Golden Thread Noodles on Harbor Road has become one of the "
        "busiest restaurants in Lowell Bay. Chef Mei Tanaka makes about 30 kilograms of noodles "
        "by hand every morning, stretching and folding the dough until the strands are thinner "
        "than a pencil lead. The menu has only eight dishes, and the shop closes as soon as the "
        "noodles run out, often before 2 p.m. Diners regularly queue along the pavement at "
        "lunchtime."
    ),
    # 85
    (
        "The 112th Kenmore Regatta took place on Lake Kenmore last Saturday, with 68 crews from "
        "eleven clubs competing over a 2,000-meter course. The men's eight was won by Stonebridge "
        "Rowing Club in a time of 5 minutes 48 seconds, a course record. In the women's single "
        "sculls, 19-year-old Freya Nilsen beat the defending champion by less than a second. "
        "Strong crosswinds forced organizers to delay the afternoon races by forty minutes."
    ),
    # 86
    (
        "The third Windmere Poetry Festival will run from May 9 to 11, with readings in the "
        "church, the bookshop and a marquee on the village green. Twenty-four poets are taking "
        "part, including the festival's patron, Ruth Abernathy, whose collection 'Salt Roads' "
        "won a national prize last year. A competition for young writers under eighteen "
        "received 430 entries. Most events are free, though the closing reading requires a "
        "ticket."
    ),
    # 87
    (
        "The bike-share scheme in Hollingford recorded 182,000 trips in its first full year, "
        "well above the 120,000 that planners had predicted. The system has 400 bicycles, "
        "including 150 electric models, spread across 38 docking stations. The average trip "
        "lasted 14 minutes, and the busiest station was outside the central railway station. A "
        "ride of up to 30 minutes costs 1.50 dollars, while annual members pay 60 dollars a year."
    ),
    # 88
    (
        "The clock on the tower of St Aldric's Church in Bramley is ticking again after being "
        "silent for nearly six years. The mechanism, made in 1881 by a clockmaker in the nearby "
        "city of Leyton, was taken apart and cleaned by specialist Martin Hale, who replaced two "
        "worn gears by hand. The repair cost 18,500 dollars, raised mostly through a village "
        "appeal. The clock's bell will strike the hours between 7 a.m. and 10 p.m."
    ),
    # 89
    (
        "The Grauwand Hut, a mountain refuge at 2,480 meters, has reopened after a two-year "
        "rebuild. The new hut has 54 beds, solar panels on its south wall and a system that "
        "collects and filters rainwater. It is reached by a steep path of about three and a half "
        "hours from the village of Tessen. The hut is staffed from late June to the end of "
        "September, and hikers are asked to book beds in advance."
    ),
]


QUESTIONS: list[tuple[int, str]] = [
    (0, "When was the Millbrook footbridge finished?"),
    (1, "Which national capitals stand on the banks of the Danube?"),
    (2, "How high is Mount Kilimanjaro?"),
    (3, "In what year was Hobart founded?"),
    (4, "On which street did the Great Fire of London start?"),
    (5, "At what temperature range does yeast work best?"),
    (6, "Who invented the QR code?"),
    (7, "How many hearts does the common octopus have?"),
    (8, "In which city was the pizza Margherita said to have been created?"),
    (9, "In what year was the marathon distance officially fixed?"),
    (10, "How long is the mural on Canal Street?"),
    (11, "How many regular stalls did the market have in 2023?"),
    (12, "What percentage of residents asked for evening hours?"),
    (13, "How many stone viaducts does the Glenvar Valley Railway cross?"),
    (14, "For how long should you wash your hands with soap and water?"),
    (15, "In which months is lake-effect snow strongest?"),
    (16, "For how much did Walter Hunt sell the rights to the safety pin?"),
    (17, "How deep is Lake Baikal at its lowest point?"),
    (18, "Where does the Mekong River begin?"),
    (19, "Until what year was Kyoto the capital of Japan?"),
    (20, "How long is the repaving work expected to last?"),
    (21, "In which three scripts is the decree on the Rosetta Stone written?"),
    (22, "At what angle does the main rainbow appear?"),
    (23, "What did the first text message say?"),
    (24, "How far does the Arctic tern fly on its yearly round trip?"),
    (25, "How much does each wheel of cheese weigh?"),
    (26, "Who founded Redfield Rovers?"),
    (27, "When did the Sydney Opera House open?"),
    (28, "How many new jobs will the Bluefern Coffee expansion create?"),
    (29, "What is the highest point on the Ridgeback Trail?"),
    (30, "What share of the sunburn-causing rays does SPF 30 filter out?"),
    (31, "For how long did the hail fall in Wexley?"),
    (32, "What did Laennec first roll into a tube to listen to the heartbeat?"),
    (33, "At what altitude does the Atacama Large Millimeter Array sit?"),
    (34, "What percentage of Madagascar's wildlife is found nowhere else?"),
    (35, "Where was the first transcontinental railroad completed?"),
    (36, "Why does the metal spoon feel colder than the wooden one?"),
    (37, "How many times has the Shelfmate app been downloaded?"),
    (38, "How many barn owls were released?"),
    (39, "In what year was kimjang added to UNESCO's list?"),
    (40, "How old was the winner of the top section?"),
    (41, "How much do adult tickets cost?"),
    (42, "When did the Grayson shoe factory close?"),
    (43, "In what year was the old play equipment installed?"),
    (44, "How many time zones does the Trans-Siberian Railway cross?"),
    (45, "Where do the walking groups meet?"),
    (46, "What nickname have locals given the fog?"),
    (47, "Which company popularized the name 'zipper'?"),
    (48, "What is the highest summit in the Andes?"),
    (49, "When was Port Alder granted a charter?"),
    (50, "When was the Gannet Head lighthouse first lit?"),
    (51, "How much more space does ice take up than liquid water?"),
    (52, "What was the first product scanned with a barcode at a checkout?"),
    (53, "How many times a minute can a hummingbird's heart beat during flight?"),
    (54, "What kind of pie won the contest?"),
    (55, "How long is the race route?"),
    (56, "From what year does the oldest quilt date?"),
    (57, "By what percentage did visitor numbers rise?"),
    (58, "How much money did the pupils raise?"),
    (59, "How many passengers can the Saint Brigid carry?"),
    (60, "On which day of the week are the free checks offered?"),
    (61, "Around what date does the monsoon reach Kerala?"),
    (62, "Who created the adhesive used in Post-it Notes?"),
    (63, "How large is the Sahara?"),
    (64, "How many pupils attend Kesby's primary school?"),
    (65, "Who built the sawmill in 1794?"),
    (66, "At what temperature range is the main compartment usually kept?"),
    (67, "How many wireless access points were installed?"),
    (68, "How long does the male emperor penguin keep the egg on his feet?"),
    (69, "How many raised beds does the garden have?"),
    (70, "How many lanes does the new pool have?"),
    (71, "What is the title of the new piece?"),
    (72, "Who runs Pemberton Hardware today?"),
    (73, "How was Mittens identified?"),
    (74, "How many locks are on the route from Hadley to Stourmouth?"),
    (75, "How many pupils in the pilot needed glasses?"),
    (76, "What was the previous temperature record in Ferndale?"),
    (77, "Which company began producing Sholes's typewriter?"),
    (78, "Which two countries share Victoria Falls?"),
    (79, "Since what year has the funicular linked the old town and the station?"),
    (80, "Who won the marathon at the 1896 Olympic Games?"),
    (81, "What is the scattering effect called?"),
    (82, "When will the club decide whether to buy the mowers?"),
    (83, "How many beavers were released?"),
    (84, "How many dishes are on the menu?"),
    (85, "What time did Stonebridge Rowing Club record in the men's eight?"),
    (86, "How many entries did the young writers' competition receive?"),
    (87, "How many trips were recorded in the first full year?"),
    (88, "Who repaired the clock mechanism?"),
    (89, "At what altitude is the Grauwand Hut?"),
]


SNIPPETS: list[tuple[str, str]] = [
    (
        "count_word_frequencies",
        '''def count_word_frequencies(text):
    """Return a dict mapping each lowercase word to how often it appears."""
    counts = {}
    for raw_word in text.split():
        word = raw_word.strip(".,;:!?()").lower()
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return counts
''',
    ),
    (
        "is_palindrome",
        '''def is_palindrome(phrase):
    """Check whether a phrase reads the same backward, ignoring case and spaces."""
    letters = [ch.lower() for ch in phrase if ch.isalnum()]
    left, right = 0, len(letters) - 1
    while left < right:
        if letters[left] != letters[right]:
            return False
        left += 1
        right -= 1
    return True
''',
    ),
    (
        "parse_duration",
        '''def parse_duration(text):
    """Convert a string such as '1h30m' or '45m' into a number of minutes."""
    total_minutes = 0
    number = ""
    for ch in text.strip().lower():
        if ch.isdigit():
            number += ch
        elif ch == "h" and number:
            total_minutes += int(number) * 60
            number = ""
        elif ch == "m" and number:
            total_minutes += int(number)
            number = ""
        else:
            raise ValueError(f"unexpected character {ch!r} in {text!r}")
    if number:
        raise ValueError(f"missing unit after {number!r}")
    return total_minutes
''',
    ),
    (
        "days_in_month",
        '''def days_in_month(year, month):
    if month == 2:
        is_leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        return 29 if is_leap else 28
    if month in (4, 6, 9, 11):
        return 30
    if 1 <= month <= 12:
        return 31
    raise ValueError(f"invalid month: {month}")
''',
    ),
    (
        "items_to_restock",
        '''def items_to_restock(inventory, threshold=10):
    """Return the names of items whose quantity is below the threshold, lowest first."""
    low_items = []
    for item_name, quantity in inventory.items():
        if quantity < threshold:
            low_items.append((quantity, item_name))
    low_items.sort()
    return [item_name for quantity, item_name in low_items]
''',
    ),
    (
        "letter_grade",
        '''def letter_grade(score):
    if score < 0 or score > 100:
        raise ValueError("score must be between 0 and 100")
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"
''',
    ),
    (
        "class_averages",
        '''def class_averages(grades_by_student):
    """Map each student to the mean of their grades, rounded to one decimal."""
    averages = {}
    for student, grades in grades_by_student.items():
        if grades:
            averages[student] = round(sum(grades) / len(grades), 1)
        else:
            averages[student] = None
    return averages
''',
    ),
    (
        "polygon_area",
        '''def polygon_area(vertices):
    """Area of a simple polygon given as (x, y) points, using the shoelace formula."""
    count = len(vertices)
    if count < 3:
        return 0.0
    twice_area = 0.0
    for index in range(count):
        x1, y1 = vertices[index]
        x2, y2 = vertices[(index + 1) % count]
        twice_area += x1 * y2 - x2 * y1
    return abs(twice_area) / 2.0
''',
    ),
    (
        "distance_between",
        '''def distance_between(point_a, point_b):
    """Straight-line distance between two (x, y) points."""
    import math

    delta_x = point_b[0] - point_a[0]
    delta_y = point_b[1] - point_a[1]
    return math.hypot(delta_x, delta_y)
''',
    ),
    (
        "parse_key_values",
        '''def parse_key_values(line):
    """Parse 'name=Ada; age=36' into {'name': 'Ada', 'age': '36'}."""
    result = {}
    for chunk in line.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        key, sep, value = chunk.partition("=")
        if not sep:
            raise ValueError(f"missing '=' in {chunk!r}")
        result[key.strip()] = value.strip()
    return result
''',
    ),
    (
        "median",
        '''def median(values):
    if not values:
        raise ValueError("median of empty list")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
''',
    ),
    (
        "tic_tac_toe_winner",
        '''def tic_tac_toe_winner(board):
    """Return 'X' or 'O' if a player has three in a row on a 3x3 board, else None."""
    lines = [list(row) for row in board]
    lines += [[board[r][c] for r in range(3)] for c in range(3)]
    lines.append([board[i][i] for i in range(3)])
    lines.append([board[i][2 - i] for i in range(3)])
    for line in lines:
        if line[0] in ("X", "O") and line.count(line[0]) == 3:
            return line[0]
    return None
''',
    ),
    (
        "count_vowels",
        '''def count_vowels(text):
    vowels = "aeiou"
    counts = {vowel: 0 for vowel in vowels}
    for ch in text.lower():
        if ch in counts:
            counts[ch] += 1
    return counts
''',
    ),
    (
        "headline_case",
        '''def headline_case(title):
    """Capitalize each word except short joining words, which stay lowercase."""
    minor_words = {
        "a", "an", "and", "at", "but", "by", "for",
        "in", "of", "on", "or", "the", "to",
    }
    words = title.lower().split()
    result = []
    for position, word in enumerate(words):
        if position == 0 or position == len(words) - 1 or word not in minor_words:
            result.append(word[:1].upper() + word[1:])
        else:
            result.append(word)
    return " ".join(result)
''',
    ),
    (
        "is_leap_year",
        '''def is_leap_year(year):
    """Gregorian rule: every fourth year, except centuries not divisible by 400."""
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
''',
    ),
    (
        "weekday_name",
        '''def weekday_name(date_text):
    """Return the English weekday name for a date written as YYYY-MM-DD."""
    import datetime

    year, month, day = (int(part) for part in date_text.split("-"))
    names = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    return names[datetime.date(year, month, day).weekday()]
''',
    ),
    (
        "order_total",
        '''def order_total(quantities, unit_prices, tax_rate=0.08):
    """Sum quantity times price for each item, then add tax; unknown items raise KeyError."""
    subtotal = 0.0
    for item, quantity in quantities.items():
        subtotal += quantity * unit_prices[item]
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)
''',
    ),
    (
        "merge_inventories",
        '''def merge_inventories(first, second):
    """Add up quantities from two stock dicts and drop items that reach zero."""
    merged = dict(first)
    for item, quantity in second.items():
        merged[item] = merged.get(item, 0) + quantity
    return {item: qty for item, qty in merged.items() if qty > 0}
''',
    ),
    (
        "rank_students",
        '''def rank_students(scores):
    """Return (rank, name, score) tuples; equal scores share a rank."""
    ordered = sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))
    ranking = []
    previous_score = None
    current_rank = 0
    for position, (name, score) in enumerate(ordered, start=1):
        if score != previous_score:
            current_rank = position
            previous_score = score
        ranking.append((current_rank, name, score))
    return ranking
''',
    ),
    (
        "circle_measurements",
        '''def circle_measurements(radius):
    import math

    if radius < 0:
        raise ValueError("radius cannot be negative")
    circumference = 2 * math.pi * radius
    area = math.pi * radius ** 2
    return {"circumference": circumference, "area": area}
''',
    ),
    (
        "split_csv_line",
        '''def split_csv_line(line, delimiter=","):
    """Split one CSV line, respecting double-quoted fields that contain the delimiter."""
    fields = []
    current = []
    in_quotes = False
    for ch in line:
        if ch == '"':
            in_quotes = not in_quotes
        elif ch == delimiter and not in_quotes:
            fields.append("".join(current))
            current = []
        else:
            current.append(ch)
    fields.append("".join(current))
    return fields
''',
    ),
    (
        "sample_variance",
        '''def sample_variance(values):
    count = len(values)
    if count < 2:
        raise ValueError("need at least two values")
    mean = sum(values) / count
    squared_gaps = [(value - mean) ** 2 for value in values]
    return sum(squared_gaps) / (count - 1)
''',
    ),
    (
        "most_common_value",
        '''def most_common_value(values):
    """Return the value that appears most often; ties go to the one seen first."""
    counts = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    best_value, best_count = None, 0
    for value in values:
        if counts[value] > best_count:
            best_value, best_count = value, counts[value]
    return best_value
''',
    ),
    (
        "scrabble_score",
        '''def scrabble_score(word):
    letter_values = {
        "aeilnorstu": 1, "dg": 2, "bcmp": 3, "fhvwy": 4,
        "k": 5, "jx": 8, "qz": 10,
    }
    total = 0
    for ch in word.lower():
        for letters, points in letter_values.items():
            if ch in letters:
                total += points
                break
    return total
''',
    ),
    (
        "caesar_shift",
        '''def caesar_shift(message, shift):
    """Shift each letter by a fixed amount, keeping case and leaving other characters."""
    shifted = []
    for ch in message:
        if ch.isalpha() and ch.isascii():
            base = ord("A") if ch.isupper() else ord("a")
            shifted.append(chr((ord(ch) - base + shift) % 26 + base))
        else:
            shifted.append(ch)
    return "".join(shifted)
''',
    ),
    (
        "slugify",
        '''def slugify(title):
    slug_chars = []
    for ch in title.lower():
        if ch.isalnum():
            slug_chars.append(ch)
        elif slug_chars and slug_chars[-1] != "-":
            slug_chars.append("-")
    return "".join(slug_chars).strip("-")
''',
    ),
    (
        "format_phone_number",
        '''def format_phone_number(raw_number):
    """Format a 10-digit number such as '5551234567' as '(555) 123-4567'."""
    digits = "".join(ch for ch in raw_number if ch.isdigit())
    if len(digits) == 11 and digits.startswith("1"):
        digits = digits[1:]
    if len(digits) != 10:
        raise ValueError(f"expected 10 digits, got {len(digits)}")
    return f"({digits[:3]}) {digits[3:6]}-{digits[6:]}"
''',
    ),
    (
        "age_in_years",
        '''def age_in_years(birth_date, today):
    """Both dates are (year, month, day) tuples."""
    birth_year, birth_month, birth_day = birth_date
    year, month, day = today
    age = year - birth_year
    if (month, day) < (birth_month, birth_day):
        age -= 1
    return age
''',
    ),
    (
        "bounding_box",
        '''def bounding_box(points):
    if not points:
        return None
    xs = [x for x, y in points]
    ys = [y for x, y in points]
    return (min(xs), min(ys), max(xs), max(ys))
''',
    ),
    (
        "classify_triangle",
        '''def classify_triangle(side_a, side_b, side_c):
    sides = sorted([side_a, side_b, side_c])
    if sides[0] <= 0 or sides[0] + sides[1] <= sides[2]:
        return "invalid"
    if sides[0] == sides[2]:
        return "equilateral"
    if sides[0] == sides[1] or sides[1] == sides[2]:
        return "isosceles"
    return "scalene"
''',
    ),
    (
        "parse_version",
        '''def parse_version(version_text):
    """Turn '2.10.3' into (2, 10, 3) so versions compare numerically."""
    parts = version_text.strip().lstrip("v").split(".")
    numbers = []
    for part in parts:
        if not part.isdigit():
            raise ValueError(f"bad version component: {part!r}")
        numbers.append(int(part))
    return tuple(numbers)
''',
    ),
    (
        "percentile_rank",
        '''def percentile_rank(values, target):
    """Percentage of values strictly below target, plus half of those equal to it."""
    if not values:
        raise ValueError("no values given")
    below = sum(1 for value in values if value < target)
    equal = sum(1 for value in values if value == target)
    return 100.0 * (below + 0.5 * equal) / len(values)
''',
    ),
    (
        "rock_paper_scissors",
        '''def rock_paper_scissors(first_move, second_move):
    beats = {"rock": "scissors", "scissors": "paper", "paper": "rock"}
    first_move, second_move = first_move.lower(), second_move.lower()
    if first_move not in beats or second_move not in beats:
        raise ValueError("moves must be rock, paper or scissors")
    if first_move == second_move:
        return "draw"
    return "first" if beats[first_move] == second_move else "second"
''',
    ),
    (
        "truncate_words",
        '''def truncate_words(text, max_words, suffix="..."):
    """Keep at most max_words words, adding a suffix when something was cut."""
    words = text.split()
    if len(words) <= max_words:
        return " ".join(words)
    return " ".join(words[:max_words]) + suffix
''',
    ),
    (
        "lines_containing",
        '''def lines_containing(text, keyword, ignore_case=True):
    """Return (line_number, line) pairs for lines that contain the keyword."""
    needle = keyword.lower() if ignore_case else keyword
    matches = []
    for number, line in enumerate(text.splitlines(), start=1):
        haystack = line.lower() if ignore_case else line
        if needle in haystack:
            matches.append((number, line))
    return matches
''',
    ),
    (
        "group_by_initial",
        '''def group_by_initial(names):
    groups = {}
    for name in names:
        cleaned = name.strip()
        if not cleaned:
            continue
        initial = cleaned[0].upper()
        groups.setdefault(initial, []).append(cleaned)
    for initial in groups:
        groups[initial].sort()
    return groups
''',
    ),
    (
        "weighted_mean",
        '''def weighted_mean(values, weights):
    """Mean of values where each one counts according to its weight."""
    if len(values) != len(weights):
        raise ValueError("values and weights must have the same length")
    total_weight = sum(weights)
    if total_weight == 0:
        raise ValueError("weights must not sum to zero")
    return sum(v * w for v, w in zip(values, weights)) / total_weight
''',
    ),
    (
        "split_bill",
        '''def split_bill(total, people, tip_percent=15):
    if people <= 0:
        raise ValueError("at least one person must pay")
    with_tip = total * (1 + tip_percent / 100)
    share = round(with_tip / people, 2)
    # the last person covers any rounding difference
    last_share = round(with_tip - share * (people - 1), 2)
    return [share] * (people - 1) + [last_share]
''',
    ),
    (
        "convert_temperatures",
        '''def convert_temperatures(readings, to_unit="C"):
    """Convert a list of temperatures between Fahrenheit and Celsius."""
    converted = []
    for reading in readings:
        if to_unit == "C":
            converted.append(round((reading - 32) * 5 / 9, 1))
        elif to_unit == "F":
            converted.append(round(reading * 9 / 5 + 32, 1))
        else:
            raise ValueError(f"unknown unit: {to_unit}")
    return converted
''',
    ),
    (
        "run_length_encode",
        '''def run_length_encode(text):
    if not text:
        return ""
    pieces = []
    current_char, run_length = text[0], 1
    for ch in text[1:]:
        if ch == current_char:
            run_length += 1
        else:
            pieces.append(f"{run_length}{current_char}")
            current_char, run_length = ch, 1
    pieces.append(f"{run_length}{current_char}")
    return "".join(pieces)
''',
    ),
    (
        "find_duplicates",
        '''def find_duplicates(items):
    """Return items that occur more than once, in order of their second appearance."""
    seen = set()
    reported = set()
    duplicates = []
    for item in items:
        if item in seen and item not in reported:
            duplicates.append(item)
            reported.add(item)
        seen.add(item)
    return duplicates
''',
    ),
    (
        "add_minutes",
        '''def add_minutes(clock_time, minutes):
    """Add minutes to a 24-hour time such as '23:45', wrapping past midnight."""
    hours_text, minutes_text = clock_time.split(":")
    total = int(hours_text) * 60 + int(minutes_text) + minutes
    total %= 24 * 60
    return f"{total // 60:02d}:{total % 60:02d}"
''',
    ),
    (
        "hangman_display",
        '''def hangman_display(secret_word, guessed_letters):
    shown = []
    for ch in secret_word:
        if not ch.isalpha() or ch.lower() in guessed_letters:
            shown.append(ch)
        else:
            shown.append("_")
    return " ".join(shown)
''',
    ),
    (
        "compound_interest_schedule",
        '''def compound_interest_schedule(principal, annual_rate, years):
    """Return the balance at the end of each year with interest compounded yearly."""
    balances = []
    balance = principal
    for year in range(1, years + 1):
        balance *= 1 + annual_rate
        balances.append((year, round(balance, 2)))
    return balances
''',
    ),
    (
        "longest_word",
        '''def longest_word(sentence):
    best = ""
    for raw_word in sentence.split():
        word = "".join(ch for ch in raw_word if ch.isalpha())
        if len(word) > len(best):
            best = word
    return best
''',
    ),
]


RENAMES: list[str] = [
    "word_counts",
    "reads_same_backward",
    "duration_to_minutes",
    "month_length",
    "low_stock_items",
    "score_to_letter",
    "student_means",
    "shoelace_area",
    "euclidean_distance",
    "parse_settings_line",
    "middle_value",
    "find_winner",
    "vowel_counts",
    "format_title",
    "has_february_29",
    "day_of_week",
    "checkout_total",
    "combine_stock",
    "leaderboard",
    "circle_properties",
    "parse_csv_fields",
    "variance_of_sample",
    "statistical_mode",
    "word_points",
    "rotate_letters",
    "make_url_slug",
    "pretty_phone",
    "completed_years",
    "enclosing_rectangle",
    "triangle_kind",
    "version_tuple",
    "rank_as_percent",
    "judge_round",
    "shorten_text",
    "grep_lines",
    "names_by_letter",
    "mean_with_weights",
    "divide_check",
    "change_temperature_scale",
    "compress_runs",
    "repeated_items",
    "shift_clock_time",
    "mask_secret_word",
    "yearly_balances",
    "find_longest_word",
]
